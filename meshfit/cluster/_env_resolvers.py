"""Resolvers from a launcher's environment (torchrun, SLURM) and an explicit `SimpleClusterResolver`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal, overload

from meshfit.cluster._base import ClusterInfo, ClusterResolver, format_endpoint
from meshfit.cluster._hostlist import expand_hostlist

DEFAULT_MASTER_PORT = 29500


@overload
def _env_int(environ: Mapping[str, str], name: str, source: str, *, minimum: int,
             maximum: int | None = None, required: Literal[True] = True, hint: str = "") -> int: ...


@overload
def _env_int(environ: Mapping[str, str], name: str, source: str, *, minimum: int,
             maximum: int | None = None, required: bool, hint: str = "") -> int | None: ...


def _env_int(environ: Mapping[str, str], name: str, source: str, *, minimum: int,
             maximum: int | None = None, required: bool = True, hint: str = "") -> int | None:
    """Read ``environ[name]`` as an int in ``minimum..maximum``; raise naming the variable."""
    bounds = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
    value = environ.get(name)
    if value is None or value.strip() == "":
        if not required:
            return None
        raise ValueError(f"Invalid {source} environment: {name} is not set. Set {name} to an integer "
                         f"{bounds}{hint}.")
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"Invalid {source} environment: {name}={value!r} is not an integer. "
                         f"Set {name} to an integer {bounds}{hint}.") from None
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"Invalid {source} environment: {name}={number} is out of range. "
                         f"Set {name} to an integer {bounds}{hint}.")
    return number


def _info(rank: int, world_size: int, master_addr: str, master_port: int,
          local_rank: int | None) -> ClusterInfo:
    return ClusterInfo(task_type="worker", task_id=rank, rank=rank, world_size=world_size,
                       num_workers=world_size, is_chief=rank == 0, master_addr=master_addr,
                       master_port=master_port, local_rank=local_rank)


def _spec(world_size: int, master_addr: str, master_port: int) -> dict[str, list[str | None]]:
    # Only rank 0's endpoint is known: everyone rendezvouses there.
    return {"worker": [format_endpoint(master_addr, master_port)] + [None] * (world_size - 1)}


class TorchrunClusterResolver(ClusterResolver):
    """Resolve the cluster from torchrun's variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``.

    Every process is a ``"worker"`` whose ``task_id`` is its rank; rank 0 is chief.
    ``MASTER_ADDR``/``MASTER_PORT`` default to ``127.0.0.1:29500`` only when ``WORLD_SIZE`` is 1.

    Args:
        environ: the environment to read; ``None`` reads ``os.environ``.

    Raises:
        ValueError: a variable is missing, not an integer, or out of range.

    Example:
        >>> r = TorchrunClusterResolver({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
        ...                              "MASTER_ADDR": "node0", "MASTER_PORT": "29400"})
        >>> r.rank, r.world_size, r.local_rank, r.is_chief, r.init_method
        (1, 4, 1, False, 'tcp://node0:29400')
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        src, hint = "torchrun", " (torchrun sets it for each process)"
        world_size = _env_int(env, "WORLD_SIZE", src, minimum=1, hint=hint)
        rank = _env_int(env, "RANK", src, minimum=0, maximum=world_size - 1, hint=hint)
        local_rank = _env_int(env, "LOCAL_RANK", src, minimum=0, maximum=world_size - 1, required=False)
        single = world_size == 1
        master_addr = env.get("MASTER_ADDR", "").strip() or ("127.0.0.1" if single else "")
        if not master_addr:
            raise ValueError("Invalid torchrun environment: MASTER_ADDR is not set while WORLD_SIZE="
                             f"{world_size}. Set MASTER_ADDR to the host name or IP of rank 0.")
        master_port = _env_int(env, "MASTER_PORT", src, minimum=1, maximum=65535, required=not single,
                               hint=" (the rendezvous port on rank 0's host)")
        master_port = DEFAULT_MASTER_PORT if master_port is None else master_port
        super().__init__(_info(rank, world_size, master_addr, master_port, local_rank),
                         _spec(world_size, master_addr, master_port))


class SlurmClusterResolver(ClusterResolver):
    """Resolve the cluster from a SLURM step: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``.

    Rank is ``SLURM_PROCID``; rank 0 is chief. The rendezvous host is the first host of
    ``SLURM_STEP_NODELIST`` (where task 0 of the step runs), else ``SLURM_JOB_NODELIST``, else
    ``SLURM_NODELIST``; ``MESHFIT_MASTER_ADDR`` overrides it. The port is ``MESHFIT_MASTER_PORT``,
    else 29500: set ``MESHFIT_MASTER_PORT`` when two jobs may share a node.

    Args:
        environ: the environment to read; ``None`` reads ``os.environ``.

    Raises:
        ValueError: a variable is missing, not an integer, out of range, or a node list is unreadable.

    Example:
        >>> r = SlurmClusterResolver({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
        ...                           "SLURM_JOB_NODELIST": "gpu[07-08]"})
        >>> r.rank, r.world_size, r.local_rank, r.master_addr, r.master_port
        (2, 4, 0, 'gpu07', 29500)
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        src = "SLURM"
        tasks_var = "SLURM_NTASKS" if "SLURM_NTASKS" in env or "SLURM_NPROCS" not in env else "SLURM_NPROCS"
        world_size = _env_int(env, tasks_var, src, minimum=1, hint=" (srun sets it; pass --ntasks)")
        rank = _env_int(env, "SLURM_PROCID", src, minimum=0, maximum=world_size - 1,
                        hint=" (srun sets it for each task)")
        local_rank = _env_int(env, "SLURM_LOCALID", src, minimum=0, required=False)
        master_addr = env.get("MESHFIT_MASTER_ADDR", "").strip()
        if not master_addr:
            for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
                if env.get(var, "").strip():
                    master_addr = expand_hostlist(env[var].strip(), var)[0]
                    break
            else:
                raise ValueError("Invalid SLURM environment: none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, "
                                 "SLURM_NODELIST is set. Run under srun/sbatch, or set MESHFIT_MASTER_ADDR "
                                 "to the host of task 0.")
        master_port = _env_int(env, "MESHFIT_MASTER_PORT", "meshfit", minimum=1, maximum=65535,
                               required=False)
        master_port = DEFAULT_MASTER_PORT if master_port is None else master_port
        super().__init__(_info(rank, world_size, master_addr, master_port, local_rank),
                         _spec(world_size, master_addr, master_port))


class SimpleClusterResolver(ClusterResolver):
    """A cluster given explicitly, for code and tests.

    A ``"worker"`` has ``task_id == rank``; a ``"chief"`` must be rank 0 (``task_id`` 0); an
    ``"evaluator"`` takes ``rank=None`` and does not count in ``world_size``. ``num_workers`` is
    ``world_size``.

    Args:
        rank: this process's rank in ``0..world_size-1``, or ``None`` for the evaluator.
        world_size: number of training processes.
        master_addr: host of rank 0.
        master_port: rendezvous port on rank 0's host.
        task_type: ``"worker"``, ``"chief"`` or ``"evaluator"``.
        local_rank: index among the processes on this host, if known.

    Raises:
        ValueError: the values are inconsistent (e.g. a chief that is not rank 0).

    Example:
        >>> SimpleClusterResolver(0, 2).is_chief
        True
    """

    def __init__(self, rank: int | None, world_size: int, master_addr: str = "127.0.0.1",
                 master_port: int = DEFAULT_MASTER_PORT, task_type: str = "worker",
                 local_rank: int | None = None) -> None:
        if task_type == "chief" and rank != 0:
            raise ValueError(f"Invalid `rank`: a 'chief' task is rank 0, received rank={rank!r}. "
                             "Pass rank=0 or task_type='worker'.")
        task_id = 0
        if task_type == "worker":
            if rank is None:
                raise ValueError("Invalid `rank`: a 'worker' task has a rank in 0..world_size-1, received "
                                 "rank=None. Pass its rank, or task_type='evaluator'.")
            task_id = rank
        info = ClusterInfo(task_type=task_type, task_id=task_id, rank=rank,
                           world_size=world_size, num_workers=world_size,
                           is_chief=rank == 0, master_addr=master_addr, master_port=master_port,
                           local_rank=local_rank)
        super().__init__(info, _spec(world_size, master_addr, master_port))
