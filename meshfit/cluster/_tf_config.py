"""`TFConfigClusterResolver`: the cluster from a TensorFlow-style ``TF_CONFIG``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from meshfit.cluster._base import ClusterInfo, ClusterResolver, parse_address

_SOURCE = "TF_CONFIG"
_EXAMPLE = ('{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
            '"task": {"type": "worker", "index": 0}}')
_JOBS = ("chief", "worker", "evaluator")
_SINGLE_TASK_JOBS = ("chief", "evaluator")


def _fail(message: str) -> ValueError:
    return ValueError(f"Invalid TF_CONFIG: {message}")


def _load(tf_config: str | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if tf_config is None:
        tf_config = os.environ.get("TF_CONFIG")
        if not tf_config:
            raise ValueError(f"TF_CONFIG is not set. Set it to a JSON object such as {_EXAMPLE}, "
                             "or pass tf_config= to TFConfigClusterResolver.")
    if isinstance(tf_config, str):
        text = tf_config
        try:
            tf_config = json.loads(text)
        except json.JSONDecodeError as e:
            raise _fail(f"not valid JSON ({e}); received {text[:200]!r}. "
                        f"Set TF_CONFIG to a JSON object such as {_EXAMPLE}.") from None
    elif not isinstance(tf_config, Mapping):
        raise TypeError(f"Invalid `tf_config`: expected a JSON string, a dict or None, "
                        f"received {type(tf_config).__name__}.")
    if not isinstance(tf_config, Mapping):
        raise _fail(f"expected a JSON object, received {type(tf_config).__name__} {str(tf_config)[:200]!r}. "
                    f"Set TF_CONFIG to a JSON object such as {_EXAMPLE}.")
    for key in ("cluster", "task"):
        if key not in tf_config:
            raise _fail(f"missing the {key!r} key; received keys {sorted(tf_config)}. "
                        f"TF_CONFIG needs both 'cluster' and 'task', e.g. {_EXAMPLE}.")
    return tf_config


def _parse_cluster(cluster: object) -> dict[str, list[str]]:
    if not isinstance(cluster, Mapping):
        raise _fail(f"cluster must be an object mapping job names to address lists, received "
                    f"{type(cluster).__name__} {cluster!r}. Set cluster to e.g. {{\"worker\": [\"host:port\"]}}.")
    jobs: dict[str, list[str]] = {}
    for job, addresses in cluster.items():
        if job == "ps":
            raise _fail("cluster.ps is set, but parameter-server training (ParameterServerStrategy) is not "
                        "supported by meshfit. Remove the 'ps' job and use 'chief'/'worker' tasks with "
                        "MultiWorkerMirroredStrategy.")
        if job not in _JOBS:
            raise _fail(f"cluster has unknown job {job!r}. Use only the jobs {list(_JOBS)}.")
        if not isinstance(addresses, list):
            raise _fail(f"cluster.{job} must be a list of \"host:port\" strings, received "
                        f"{type(addresses).__name__} {addresses!r}. Set cluster.{job} to e.g. [\"host:port\"].")
        if len(addresses) > 1 and job in _SINGLE_TASK_JOBS:
            raise _fail(f"cluster.{job} has {len(addresses)} addresses {addresses}; at most one {job} "
                        f"is allowed. Keep one address in cluster.{job} and move the others to cluster.worker.")
        if addresses:
            jobs[job] = list(addresses)
    if not jobs:
        raise _fail(f"cluster is empty ({dict(cluster)!r}). List the task addresses, e.g. {_EXAMPLE}.")
    if "chief" not in jobs and "worker" not in jobs:
        raise _fail(f"cluster has no training tasks (jobs {sorted(jobs)}). Add a 'worker' "
                    "(or 'chief') job listing the training processes.")
    seen: dict[tuple[str, int], str] = {}
    for job, addresses in jobs.items():
        for index, address in enumerate(addresses):
            field = f"cluster.{job}[{index}]"
            host, port = parse_address(address, field, _SOURCE)
            key = (host.lower(), port)
            if key in seen:
                raise _fail(f"{field}={address!r} duplicates {seen[key]}; every task needs its own "
                            "host:port. Give each task a distinct address.")
            seen[key] = f"{field}={address!r}"
    return jobs


def _parse_task(task: object, jobs: dict[str, list[str]]) -> tuple[str, int]:
    if not isinstance(task, Mapping):
        raise _fail(f"task must be an object like {{\"type\": \"worker\", \"index\": 0}}, received "
                    f"{type(task).__name__} {task!r}.")
    task_type = task.get("type")
    if task_type == "ps":
        raise _fail("task.type='ps' is not supported: meshfit has no ParameterServerStrategy. "
                    "Use task.type 'chief', 'worker' or 'evaluator'.")
    if task_type not in _JOBS:
        raise _fail(f"task.type={task_type!r} is not a known task type. Set task.type to one of {list(_JOBS)}.")
    if task_type not in jobs:
        raise _fail(f"task.type={task_type!r} is not a job in the cluster (jobs: {sorted(jobs)}). "
                    f"Add cluster.{task_type} or set task.type to one of {sorted(jobs)}.")
    if "index" not in task:
        raise _fail(f"task.index is missing. Set task.index to this process's position in "
                    f"cluster.{task_type} (0..{len(jobs[task_type]) - 1}).")
    index = task["index"]
    count = len(jobs[task_type])
    if isinstance(index, bool) or not isinstance(index, int):
        raise _fail(f"task.index={index!r} is not an integer ({type(index).__name__}). "
                    f"Set task.index to an integer in 0..{count - 1}.")
    if not 0 <= index < count:
        raise _fail(f"task.index={index} is out of range for job {task_type!r} with {count} "
                    f"task{'s' if count != 1 else ''} (cluster.{task_type} has {count} "
                    f"address{'es' if count != 1 else ''}). Set task.index to 0..{count - 1}.")
    return task_type, index


class TFConfigClusterResolver(ClusterResolver):
    """Resolve the cluster from ``TF_CONFIG``, as ``tf.distribute.cluster_resolver.TFConfigClusterResolver``.

    Jobs: ``chief`` (at most one), ``worker`` and ``evaluator`` (at most one). Ranks are the chief
    first, then the workers in order, so worker ``i`` has rank ``i + 1`` when there is a chief and
    ``i`` otherwise. The rendezvous runs on rank 0's address. ``local_rank`` counts the training
    tasks listed before this one with the same host string. Everything is validated here, before
    any socket opens.

    Args:
        tf_config: the JSON text or an already-parsed dict; ``None`` reads the ``TF_CONFIG``
            environment variable.
        rpc_layer: the protocol `master` prefixes (default: ``TF_CONFIG``'s ``"rpc_layer"``, else none).

    Raises:
        ValueError: the configuration is malformed; the message names the field and the fix.
        TypeError: ``tf_config`` is neither a string, a dict nor ``None``.

    Example:
        >>> r = TFConfigClusterResolver({"cluster": {"worker": ["h1:2222", "h2:2222"]},
        ...                              "task": {"type": "worker", "index": 1}})
        >>> r.task_type, r.task_id, r.rank, r.world_size, r.is_chief, r.master_addr
        ('worker', 1, 1, 2, False, 'h1')
    """

    def __init__(self, tf_config: str | Mapping[str, Any] | None = None, rpc_layer: str | None = None) -> None:
        config = _load(tf_config)
        jobs = _parse_cluster(config["cluster"])
        task_type, task_id = _parse_task(config["task"], jobs)
        training = [("chief", a) for a in jobs.get("chief", [])] + [("worker", a) for a in jobs.get("worker", [])]
        master_addr, master_port = parse_address(training[0][1], "cluster.chief[0]", _SOURCE)
        rank: int | None = None
        local_rank: int | None = None
        if task_type != "evaluator":
            rank = task_id + (1 if task_type == "worker" and "chief" in jobs else 0)
            host = parse_address(training[rank][1], "task", _SOURCE)[0].lower()
            local_rank = sum(parse_address(a, "task", _SOURCE)[0].lower() == host for _, a in training[:rank])
        info = ClusterInfo(
            task_type=task_type, task_id=task_id, rank=rank, world_size=len(training),
            num_workers=len(jobs.get("worker", [])), is_chief=rank == 0,
            master_addr=master_addr, master_port=master_port, local_rank=local_rank,
        )
        super().__init__(info, {job: list(addresses) for job, addresses in jobs.items()})
        self.rpc_layer = rpc_layer if rpc_layer is not None else _optional_text(config, "rpc_layer")
        self._session_master = _optional_text(config, "session_master")

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """``TF_CONFIG``'s ``"session_master"`` when set; ``""`` for a cluster of one task (a process
        alone: TensorFlow's ``TFConfigClusterResolver`` returns no master there, whatever the
        arguments); else the address of the task (see `ClusterResolver.master`), as TensorFlow's.

        Example:
            >>> r = TFConfigClusterResolver({"cluster": {"chief": ["c:2222"], "worker": ["w:2222"]},
            ...                              "task": {"type": "worker", "index": 0}, "rpc_layer": "grpc"})
            >>> r.master(), r.master("chief", 0)
            ('grpc://w:2222', 'grpc://c:2222')
        """
        if self._session_master is not None:
            return self._session_master
        jobs = self.cluster_spec().as_dict()
        if not jobs or (len(jobs) == 1 and len(next(iter(jobs.values()))) == 1):
            return ""
        return super().master(task_type, task_id, rpc_layer)


def _optional_text(config: Mapping[str, Any], key: str) -> str | None:
    """``config[key]``: a non-empty string or absent; anything else refused naming the key."""
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        example = "'grpc'" if key == "rpc_layer" else "'host:2222'"
        raise _fail(f"{key}={value!r} is not a non-empty string. Set {key} to e.g. {example}, or leave it out.")
    return value
