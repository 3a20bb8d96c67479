"""Progress on every launch path: a live bar through `meshfit launch` on a terminal, step/rate/ETA lines
in a log file, and a one-line note from workers that are not the chief."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

from _procs import child_env, finish, free_ports, kill_group, start, tf_config

TRAIN = """\
import sys, time
import numpy as np, torch
import meshfit as mf

strategy = mf.MultiWorkerMirroredStrategy()
with strategy.scope():
    torch.manual_seed(0)
    model = mf.Model(torch.nn.Linear(4, 2))
    model.compile("sgd", "mse")
slow = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.3))
callbacks = [slow] + ([mf.callbacks.ProgbarLogger(file_interval=float(sys.argv[1]))] if len(sys.argv) > 1 else [])
model.fit(np.zeros((64, 4), "float32"), np.zeros((64, 2), "float32"), batch_size=8, epochs=2,
          callbacks=callbacks)
"""

LAUNCH = [sys.executable, "-c", "import sys; from meshfit._cli import main; sys.exit(main())", "launch",
          "--workers", "2"]


def _script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return str(path)


def test_launch_on_a_terminal_passes_the_chiefs_live_bar_through(tmp_path):
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([*LAUNCH, _script(tmp_path)], env=child_env(), stdin=subprocess.DEVNULL,
                            stdout=secondary, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(secondary)
    chunks: list[tuple[float, bytes]] = []
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: the terminal's other end closed
                break
            if not data:
                break
            chunks.append((time.monotonic(), data))
        assert proc.wait(timeout=30) == 0, b"".join(c for _, c in chunks).decode(errors="replace")
    finally:
        kill_group(proc)
        os.close(primary)
    text = b"".join(c for _, c in chunks).decode(errors="replace")
    # Redraws of the chief's bar in place: a carriage return, the prefix, a partial bar with an ETA.
    redraws = re.findall(r"\r\[worker 0\] (\d)/8 \[[=>.]+\] - ETA: ", text)
    assert len(redraws) >= 3, text
    assert "[worker 0] 8/8 [==============================]" in text
    # Live: the first partial bar reached the terminal well before its epoch's final line.
    first_partial = next(t for t, c in chunks if re.search(rb"\r\[worker 0\] [1-6]/8 \[", c))
    first_final = next(t for t, c in chunks if b"8/8 [====" in c)
    assert first_final - first_partial > 0.6, text
    assert not re.search(r"\[worker 1\] \d/8", text)  # only the chief shows a bar
    assert re.findall(r"\[worker 1\] .*", text) == [
        "[worker 1] worker 1: training with 2 replicas; progress and logs are printed by the chief (worker 0).\r"]


def test_launch_into_a_log_file_writes_lines_with_step_rate_and_eta(tmp_path):
    log = tmp_path / "train.log"
    with open(log, "wb") as out:
        # --preload: the tasks forked from one preloaded process write through the same pipes
        proc = subprocess.Popen([*LAUNCH, "--preload", _script(tmp_path), "0.5"], env=child_env(), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert proc.wait(timeout=240) == 0, log.read_text()
        finally:
            kill_group(proc)
    text = log.read_text()
    assert "\r" not in text
    # meshfit's lines only: torch's native log lines ("[W1123 18:48:12.2 socket.cpp:469] ...") may
    # interleave when a store poll is slow under load.
    lines = [line for line in text.splitlines() if line.startswith("[worker 0] ")
             and not re.match(r"\[worker 0\] \[[WEI]\d{4} ", line)]
    assert lines[0] == "[worker 0] Epoch 1/2"
    progress = [line for line in lines if re.fullmatch(
        r"\[worker 0\] [1-7]/8 \[[=>.]+\] - ETA: \d+s - \d+ms/step - loss: \S+", line)]
    assert len(progress) >= 2, text  # every 0.5 s of a 2.4 s epoch
    finals = [line for line in lines if line.startswith("[worker 0] 8/8 [==============================] - ")]
    assert len(finals) == 2, text  # one line per epoch


def test_a_worker_started_in_the_foreground_says_it_trains_and_where_logs_are(tmp_path):
    ports = free_ports(2)
    script = _script(tmp_path)
    # The tutorial's way: worker 0 in the background, worker 1 in the foreground of its own terminal.
    background = start([script], child_env(TF_CONFIG=tf_config(ports, 0)))
    try:
        foreground = start([script], child_env(TF_CONFIG=tf_config(ports, 1)))
        code1, out1 = finish(foreground, timeout=240)
    finally:
        code0, out0 = finish(background, timeout=60)
    assert code0 == 0 and code1 == 0, out0 + out1
    assert out1.splitlines() == [
        "worker 1: training with 2 replicas; progress and logs are printed by the chief (worker 0)."]
    assert "Epoch 2/2" in out0 and "training with 2 replicas" not in out0


def test_meshfit_demo_shows_backups_a_crash_the_resume_and_leaves_a_picture(tmp_path):
    output, backup = tmp_path / "out", tmp_path / "backup"
    log = tmp_path / "demo.log"
    command = [sys.executable, "-c", "import sys; from meshfit._cli import main; sys.exit(main())", "demo",
               "--epochs", "2", "--steps-per-epoch", "6", "--save-freq", "4", "--crash-at-step", "7",
               "--output-dir", str(output), "--backup-dir", str(backup)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=child_env(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert proc.wait(timeout=400) == 0, log.read_text()
        finally:
            kill_group(proc)
    text = log.read_text()
    lines = text.splitlines()
    assert f"[worker 0] backup written at step 4 (epoch 1, batch 4): {backup}/ckpt-1" in lines, text
    assert "[worker 1] worker 1: simulating a crash at step 7 (meshfit demo --crash-at-step 0 turns this off)" \
        in lines, text
    assert "meshfit launch: worker 1 exited with code 1; restarting the group (restart 1 of 2)" in lines, text
    # Resumed at the last backup (step 4), which the restarted chief names.
    assert f"[worker 0] BackupAndRestore: resuming from {backup}/ckpt-1 at epoch 1, batch 5 (iteration 4)" \
        in lines, text
    assert f"[worker 0] backup written at step 8 (epoch 2, batch 2): {backup}/ckpt-2" in lines, text
    picture = output / "training.png"
    assert f"[worker 0] training curves (loss and accuracy per epoch) drawn in {picture}" in lines, text
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (output / "model.keras").is_file()
    assert "\r" not in text  # no redraws in a log
    # No blank lines from meshfit; torch's native warnings (``[W1123 ...] ...`` with a C++ trace) bring their own.
    for index, line in enumerate(lines):
        if line.strip() in ("[worker 0]", "[worker 1]"):
            before = lines[max(0, index - 40):index]
            assert any(re.match(r"\[worker \d\] \[[WEI]\d{4} ", b) or "Exception raised from" in b for b in before), \
                (index, text)
