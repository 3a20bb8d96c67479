"""One worker of tests/test_torch_loader.py started as a real process (TF_CONFIG from the test):
its DataLoader may start worker processes of its own. Prints the example ids of each epoch as JSON."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_torch_loader import _train  # noqa: E402

if __name__ == "__main__":
    print("IDS " + json.dumps(_train(int(json.loads(os.environ["TF_CONFIG"])["task"]["index"]), 2, sys.argv[1])))
