"""``meshfit launch``'s ``[worker i]`` labels name the worker that wrote each line, on a terminal too.

On a terminal the launcher forwards output as it comes (`_pump_live`), so a live progress bar can
leave a worker's line unfinished when another worker's line arrives: the launcher ends the
unfinished line first. The rest of that line used to follow with no label, right under the other
worker's line, so it read as that worker's output (checked before the fix: ``[worker 1] hello``
then a bare ``def`` that worker 0 wrote). The worker's own index comes from the ``TF_CONFIG`` the
launcher gives it, the label from the same ``(task_type, index)`` (``_start_round``, ``ChildGroup.adopt``),
cold, from a standby and with ``--preload`` alike (tests/test_launch.py).
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time

from meshfit._runtime._supervisor import Output, _pump_live


class _Captured(io.TextIOWrapper):
    def __init__(self) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8")

    def value(self) -> bytes:
        self.flush()
        assert isinstance(self.buffer, io.BytesIO)
        return self.buffer.getvalue()


def _capture(monkeypatch) -> _Captured:
    """Our stdout replaced inside the test (pytest re-installs its own capture after a fixture's setup)."""
    captured = _Captured()
    monkeypatch.setattr(sys, "stdout", captured)
    return captured


def _wait_for(captured: _Captured, text: bytes) -> None:
    deadline = time.monotonic() + 10
    while text not in captured.value():
        assert time.monotonic() < deadline, captured.value()
        time.sleep(0.01)


def _live(output: Output, name: str) -> tuple[int, threading.Thread]:
    read, write = os.pipe()
    reader = threading.Thread(target=_pump_live, args=(os.fdopen(read, "rb"), f"[{name}] ".encode(), False, output),
                              daemon=True)
    reader.start()
    return write, reader


def test_the_rest_of_a_line_cut_by_another_workers_line_keeps_its_label(monkeypatch):
    stdout = _capture(monkeypatch)
    output = Output()
    worker0, reader0 = _live(output, "worker 0")
    worker1, reader1 = _live(output, "worker 1")
    os.write(worker0, b"abc")  # an unfinished line (a live bar)
    _wait_for(stdout, b"abc")
    os.write(worker1, b"hello\n")
    _wait_for(stdout, b"hello\n")
    os.write(worker0, b"def\n")
    for fd, reader in ((worker0, reader0), (worker1, reader1)):
        os.close(fd)
        reader.join(10)
        assert not reader.is_alive()
    assert stdout.value().splitlines() == [b"[worker 0] abc", b"[worker 1] hello", b"[worker 0] def"]


def test_a_cut_bar_redrawn_after_a_launcher_message_is_labelled_once(monkeypatch):
    stdout = _capture(monkeypatch)
    output = Output()
    worker0, reader0 = _live(output, "worker 0")
    os.write(worker0, b"1/3 [==")
    _wait_for(stdout, b"1/3")
    output.message("worker 1 exited with code 0")  # on stderr: it ends the bar's line all the same
    os.write(worker0, b"\r2/3 [====\r")  # a redraw, then a carriage return that ends the chunk
    _wait_for(stdout, b"2/3")
    output.write(False, b"[worker 1] done\n", writer="worker 1's pipe")
    os.write(worker0, b"3/3 [======]\n")
    os.close(worker0)
    reader0.join(10)
    lines = stdout.value().replace(b"\r", b"\n").split(b"\n")
    assert [line for line in lines if line] == [b"[worker 0] 1/3 [==", b"[worker 0] 2/3 [====", b"[worker 1] done",
                                                b"[worker 0] 3/3 [======]"]
