"""TensorFlow's "Multi-worker training with Keras" tutorial's path helpers (seed 000), as written there.

Every worker saves: the chief to the path it is given, the others to a temporary folder of their own
(``workertemp_<task_id>`` beside it) that they delete after. The tests run the tutorial's code as a
user copies it; only the names lose the tutorial's leading underscore, to be imported.
"""

from __future__ import annotations

import os


def is_chief(task_type, task_id):
    # As in the tutorial: only `worker` tasks, worker 0 is the chief; `None` is a single worker.
    return (task_type == "worker" and task_id == 0) or task_type is None


def get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)  # tf.io.gfile.makedirs
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not is_chief(task_type, task_id):
        dirpath = get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)
