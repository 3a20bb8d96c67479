"""keras.io's MLP (784-256-256-10, Adam, batch 32) trained by TF 2.x Keras ``fit``; run with .venv-tf's python.

The TensorFlow side of ``bench_all.py``'s MLP comparison (TF is never a meshfit dependency: see
``tf_venv.sh``). One intra-op and one inter-op thread. The first epoch is a warm-up.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


class EpochClock(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.marks = []

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.marks.append((time.perf_counter(), time.process_time()))

    def on_train_end(self, logs=None):
        self.marks.append((time.perf_counter(), time.process_time()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    data = np.load(args.data)
    dataset = tf.data.Dataset.from_tensor_slices((data["x"], data["y"])).repeat().batch(32)
    inputs = keras.Input(shape=(784,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    hidden = keras.layers.Dense(256, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    clock = EpochClock()
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0, callbacks=[clock])
    (w0, c0), (w1, c1) = clock.marks
    timed = (args.epochs - 1) * args.steps
    with open(args.out, "w") as f:
        json.dump({"ms_per_step": (w1 - w0) * 1e3 / timed, "cpu_ms_per_step": (c1 - c0) * 1e3 / timed,
                   "tensorflow": tf.__version__, "keras": keras.__version__}, f)


if __name__ == "__main__":
    main()
