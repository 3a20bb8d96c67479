"""The seams the Estimator shares with `Model.fit`: the training loop, its saver and its reductions.

One import site, so the Estimator runs on exactly the loop, checkpoint saver and evaluation loop
that ``fit`` runs on.
"""

from meshfit._evaluation import evaluate as evaluation_loop
from meshfit._loop import TrainingLoop
from meshfit.callbacks._checkpoint_saver import CheckpointSaver, SavePolicy

__all__ = ["CheckpointSaver", "SavePolicy", "TrainingLoop", "evaluation_loop"]
