#!/usr/bin/env bash
# Create .venv-tf: a separate virtual environment with tensorflow-cpu, used ONLY by the benchmark
# (bench/bench_keras_mlp.py measures TF 2.x Keras `fit` beside meshfit). TensorFlow is never a
# dependency of meshfit. It is big (~600 MB): run this once, by hand or through `make tf-venv`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
VENV="${TF_VENV:-.venv-tf}"
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "tensorflow-cpu>=2.16,<3"
"$VENV/bin/python" -c "import tensorflow as tf, keras; print('tensorflow', tf.__version__, 'keras', keras.__version__)"
