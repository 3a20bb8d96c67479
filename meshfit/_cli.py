"""The ``meshfit`` command: ``meshfit launch ...`` and ``meshfit demo``."""

from __future__ import annotations

import argparse
import sys

from meshfit._runtime import main as launch
from meshfit._version import __version__


def _demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshfit demo",
        description="Train the seed tutorial's CNN on bundled digits with several workers "
                    "(meshfit launch), fault tolerance on and shown: backups are announced, one worker "
                    "crashes on purpose and the group resumes from the last backup. Leaves the model and "
                    "a picture of the training curves in --output-dir.")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-restarts", type=int, default=2, help="group restarts after a failure (default 2)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument("--steps-per-epoch", type=int, default=None, help="steps per epoch (default: one pass)")
    parser.add_argument("--backup-dir", default=None, help="BackupAndRestore directory (default: a temp dir)")
    parser.add_argument("--save-freq", type=int, default=10, help="steps between backups (default 10)")
    parser.add_argument("--crash-at-step", type=int, default=35,
                        help="the last worker crashes at this step in the first round, to show the resume "
                             "(default 35; 0: no crash)")
    parser.add_argument("--output-dir", default="meshfit-demo",
                        help="where model.keras and training.png are written (default ./meshfit-demo)")
    args = parser.parse_args(argv)
    script_args = ["--epochs", str(args.epochs), "--save-freq", str(args.save_freq),
                   "--crash-at-step", str(args.crash_at_step), "--output-dir", args.output_dir]
    if args.steps_per_epoch:
        script_args += ["--steps-per-epoch", str(args.steps_per_epoch)]
    if args.backup_dir:
        script_args += ["--backup-dir", args.backup_dir]
    return launch(["--workers", str(args.workers), "--max-restarts", str(args.max_restarts),
                   "-m", "meshfit._demo", *script_args])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshfit`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"launch": "run a script on N local workers, each with its own TF_CONFIG",
                "demo": "train the seed CNN with 2 workers and fault tolerance"}
    if argv and argv[0] in ("-V", "--version"):
        print(f"meshfit {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        usage = "usage: meshfit [--version] {launch,demo} ...\n\n" + "\n".join(f"  {k:8s}{v}" for k, v in commands.items())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"meshfit: unknown command {argv[0]!r}\n\n{usage}", file=sys.stderr)
            return 2
        print(usage)
        return 0 if argv else 2
    if argv[0] == "launch":
            return launch(argv[1:])
    return _demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
