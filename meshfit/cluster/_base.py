"""`ClusterInfo` (what a process needs to join the job) and the `ClusterResolver` base class."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from meshfit.cluster._cluster_spec import ClusterSpec

TASK_TYPES = ("chief", "worker", "evaluator")


def parse_address(address: object, field: str, source: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[ipv6]:port"``) into ``(host, port)``; raise naming ``field``."""
    fix = (f"Set {field} to \"host:port\" with a port in 1..65535, e.g. \"10.0.0.1:12345\" "
           "(IPv6 as \"[::1]:12345\").")
    if not isinstance(address, str):
        raise ValueError(f"Invalid {source}: {field} must be a \"host:port\" string, "
                         f"received {address!r} ({type(address).__name__}). {fix}")
    if address.startswith("["):
        host, bracket, rest = address[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ValueError(f"Invalid {source}: {field}={address!r} has no port after the bracketed "
                             f"IPv6 host. {fix}")
        port_text = rest[1:]
    else:
        host, colon, port_text = address.rpartition(":")
        if not colon:
            raise ValueError(f"Invalid {source}: {field}={address!r} has no port. {fix}")
        if ":" in host:
            raise ValueError(f"Invalid {source}: {field}={address!r} looks like an IPv6 address without "
                             f"brackets. {fix}")
    if not host:
        raise ValueError(f"Invalid {source}: {field}={address!r} has an empty host. {fix}")
    if any(c.isspace() or not c.isprintable() for c in host):
        raise ValueError(f"Invalid {source}: {field}={address!r} has a host with spaces or control "
                         f"characters ({host!r}), which no machine is named. {fix}")
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"Invalid {source}: {field}={address!r} has port {port_text!r}, which is not a "
                         f"number in 1..65535. {fix}")
    return host, int(port_text)


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class ClusterInfo:
    """Where this process sits in the job: everything needed to join the process group.

    Attributes:
        task_type: ``"chief"``, ``"worker"`` or ``"evaluator"``.
        task_id: index of this task within its job (``task.index`` in ``TF_CONFIG``).
        rank: the torch.distributed rank (chief first, then workers); ``None`` for the evaluator,
            which does not join the training process group.
        world_size: number of training processes (chief + workers; the evaluator is not counted).
        num_workers: number of tasks in the ``worker`` job (the chief, if any, is not counted).
        is_chief: ``True`` for the ``chief`` task, or worker 0 when there is no chief.
        master_addr: host of rank 0, where the TCP rendezvous runs.
        master_port: port of rank 0's rendezvous.
        local_rank: index of this process among the training processes on its host, or ``None``
            when unknown.

    Example:
        >>> ClusterInfo(task_type="worker", task_id=1, rank=1, world_size=2, num_workers=2,
        ...             is_chief=False, master_addr="127.0.0.1", master_port=29500).init_method
        'tcp://127.0.0.1:29500'
    """

    task_type: str
    task_id: int
    rank: int | None
    world_size: int
    num_workers: int
    is_chief: bool
    master_addr: str
    master_port: int
    local_rank: int | None = None

    def __post_init__(self) -> None:
        if self.task_type not in TASK_TYPES:
            raise ValueError(f"Invalid `task_type`: expected one of {TASK_TYPES}, "
                             f"received task_type={self.task_type!r}.")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Invalid `world_size`: expected a positive int, "
                             f"received world_size={self.world_size!r}.")
        if self.task_type == "evaluator":
            if self.rank is not None:
                raise ValueError(f"Invalid `rank`: the evaluator has no training rank; pass rank=None, "
                                 f"received rank={self.rank!r}.")
        elif not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Invalid `rank`: expected an int in 0..{self.world_size - 1} "
                             f"(world_size={self.world_size}), received rank={self.rank!r}.")
        if not isinstance(self.task_id, int) or self.task_id < 0:
            raise ValueError(f"Invalid `task_id`: expected a non-negative int, received task_id={self.task_id!r}.")
        if not isinstance(self.master_port, int) or not 1 <= self.master_port <= 65535:
            raise ValueError(f"Invalid `master_port`: expected an int in 1..65535, "
                             f"received master_port={self.master_port!r}.")
        if not self.master_addr:
            raise ValueError(f"Invalid `master_addr`: expected a host name or IP, "
                             f"received master_addr={self.master_addr!r}.")

    @property
    def init_method(self) -> str:
        """``tcp://master_addr:master_port`` for ``torch.distributed.init_process_group``."""
        return "tcp://" + format_endpoint(self.master_addr, self.master_port)


class ClusterResolver:
    """Base class: a resolved view of the cluster for this process.

    Subclasses parse their source (``TF_CONFIG``, torchrun or SLURM environment) eagerly in
    ``__init__`` so that a bad configuration fails before any socket opens.

    Attributes:
        synthetic: ``True`` when meshfit made the resolver up because nothing described a cluster
            (one plain process, `MirroredStrategy`'s local replicas, a group formed by hand); code
            that asks where the job was launched (``RunConfig``) then reads the environment itself.
    """

    synthetic: bool = False

    def __init__(self, info: ClusterInfo, cluster_spec: dict[str, list[str | None]]) -> None:
        self._info = info
        self._cluster_spec = cluster_spec

    @property
    def task_type(self) -> str | None:
        """``"chief"``, ``"worker"`` or ``"evaluator"`` (``None``: no launcher named this task)."""
        return self._info.task_type

    @property
    def task_id(self) -> int | None:
        """Index of this task within its job (``None``: no launcher named this task)."""
        return self._info.task_id

    @property
    def rank(self) -> int | None:
        """torch.distributed rank, or ``None`` for the evaluator."""
        return self._info.rank

    @property
    def world_size(self) -> int:
        """Number of training processes (chief + workers)."""
        return self._info.world_size

    @property
    def num_workers(self) -> int:
        """Number of tasks in the ``worker`` job."""
        return self._info.num_workers

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief (the ``chief`` task, or worker 0 without one)."""
        return self._info.is_chief

    @property
    def master_addr(self) -> str:
        """Host of rank 0."""
        return self._info.master_addr

    @property
    def master_port(self) -> int:
        """Rendezvous port on rank 0's host."""
        return self._info.master_port

    @property
    def local_rank(self) -> int | None:
        """Index among the training processes on this host, or ``None`` when unknown."""
        return self._info.local_rank

    @property
    def init_method(self) -> str:
        """``tcp://host:port`` of rank 0, for ``torch.distributed.init_process_group``."""
        return self._info.init_method

    def cluster_spec(self) -> ClusterSpec:
        """The cluster as a `ClusterSpec` (a ``{job: ["host:port", ...]}`` dict with ``as_dict()``);
        addresses the source does not give are ``None``."""
        return ClusterSpec(copy.deepcopy(self._cluster_spec))

    @property
    def rpc_layer(self) -> str | None:
        """The protocol `master` prefixes (``"grpc"``...); None: none (TensorFlow's default)."""
        return getattr(self, "_rpc_layer", None)

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        if value is not None and (not isinstance(value, str) or not value or "://" in value):
            raise ValueError(f"Invalid `rpc_layer`: expected a protocol name such as 'grpc', or None, "
                             f"received rpc_layer={value!r}.")
        self._rpc_layer = value

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of a task, as TensorFlow's ``cluster_resolver.master()``: ``"host:port"``, or
        ``"grpc://host:port"`` with an ``rpc_layer``; ``""`` where the task is unknown.

        Args:
            task_type: the job (default: this task's); ``"chief"``, ``"worker"`` or ``"evaluator"``.
            task_id: the task's index in its job (default: this task's).
            rpc_layer: the protocol to prefix (default: `rpc_layer`).

        Raises:
            ValueError: the cluster has no such job, or the job no such index (the message names
                the jobs and the range).

        Example:
            >>> from meshfit.cluster import TFConfigClusterResolver
            >>> r = TFConfigClusterResolver({"cluster": {"worker": ["h1:2222", "h2:2222"]},
            ...                              "task": {"type": "worker", "index": 1}})
            >>> r.master(), r.master("worker", 0, rpc_layer="grpc")
            ('h2:2222', 'grpc://h1:2222')
        """
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        if address is None:  # the source does not give it (torchrun, SLURM: only rank 0's is known)
            return ""
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: object = None) -> dict[str, int]:
        """The accelerators this host has, by kind (``{"GPU": 8}``; ``{}`` without), as TensorFlow's.

        Counted on this host: the arguments are accepted for TensorFlow's signature.
        """
        import torch  # not at import: resolving a cluster needs no torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"GPU": count} if count else {}

    def __repr__(self) -> str:
        i = self._info
        return (f"{type(self).__name__}(task_type={i.task_type!r}, task_id={i.task_id}, rank={i.rank}, "
                f"world_size={i.world_size}, master={format_endpoint(i.master_addr, i.master_port)!r})")
