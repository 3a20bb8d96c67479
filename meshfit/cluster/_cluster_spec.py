"""`ClusterSpec`: the jobs of a cluster and their tasks' addresses, as ``tf.train.ClusterSpec``."""

from __future__ import annotations

import copy


class ClusterSpec(dict):
    """``{job: ["host:port", ...]}`` with TensorFlow's ``ClusterSpec`` methods.

    It is a dict (the form meshfit always returned), so ``spec["worker"]`` keeps working;
    ``as_dict()``, ``jobs``, ``num_tasks(job)`` and ``task_address(job, index)`` are TF's names.
    Addresses a resolver does not know (torchrun, SLURM) are ``None``.

    Example:
        >>> spec = ClusterSpec({"worker": ["localhost:1", "localhost:2"]})
        >>> spec.as_dict(), spec.num_tasks("worker"), "chief" in spec.as_dict()
        ({'worker': ['localhost:1', 'localhost:2']}, 2, False)
    """

    def as_dict(self) -> dict[str, list[str | None]]:
        """A plain copy: ``{job: [address, ...]}``."""
        return {job: copy.deepcopy(tasks) for job, tasks in self.items()}

    @property
    def jobs(self) -> list[str]:
        """The job names."""
        return list(self)

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has.

        Raises:
            ValueError: if the job is not in the cluster.
        """
        return len(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str | None:
        """The address of task ``task_index`` of ``job_name``.

        Raises:
            ValueError: if the job or the index is not in the cluster.
        """
        tasks = self._tasks(job_name)
        if isinstance(task_index, bool) or not isinstance(task_index, int) or not 0 <= task_index < len(tasks):
            raise ValueError(f"Invalid `task_index`: expected 0 <= index < {len(tasks)} for job {job_name!r}, "
                             f"received task_index={task_index!r}.")
        return tasks[task_index]

    def _tasks(self, job_name: str) -> list[str | None]:
        if job_name not in self:
            raise ValueError(f"Invalid `job_name`: expected one of {sorted(self)}, received job_name={job_name!r}.")
        return self[job_name]

    def __bool__(self) -> bool:
        return len(self) > 0
