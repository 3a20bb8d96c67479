"""Progbar and ProgbarLogger: Keras's output format, on terminals and on files."""

from __future__ import annotations

import io
import re

import pytest
import torch

from meshfit.callbacks import CallbackList, Progbar, ProgbarLogger, _progbar


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(_progbar, "_now", fake)
    return fake


def test_file_stream_prints_only_the_final_line(clock):
    out = io.StringIO()
    bar = Progbar(target=70, stream=out)
    for step in range(1, 71):
        clock.now += 0.007
        bar.update(step, [("loss", 2.27), ("accuracy", 0.22)])
    text = out.getvalue()
    assert "\r" not in text and "\b" not in text
    assert text == "70/70 [==============================] - 0s 7ms/step - loss: 2.2700 - accuracy: 0.2200\n"


def test_file_stream_long_epoch_prints_a_line_every_30_seconds(clock):
    out = io.StringIO()
    bar = Progbar(target=100, stream=out)
    for step in range(1, 101):
        clock.now += 1.0
        bar.update(step, {"loss": 1.0})
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 4  # at 30 s, 60 s, 90 s, then the final line
    # Step, time per step (the rate) and ETA on each progress line.
    assert lines[0] == " 30/100 [========>.....................] - ETA: 1:10 - 1s/step - loss: 1.0000"
    assert lines[-1] == "100/100 [==============================] - 100s 1s/step - loss: 1.0000"


def test_tty_redraws_in_place_and_throttles(clock):
    out = FakeTTY()
    bar = Progbar(target=10, stream=out, interval=0.05)
    bar.update(1, {"loss": 0.5})
    bar.update(2, {"loss": 0.5})  # no time passed: throttled
    clock.now += 0.1
    bar.update(5, {"loss": 0.5})
    clock.now += 0.1
    bar.update(10, {"loss": 0.25})
    text = out.getvalue()
    frames = text.split("\r")[1:]
    assert len(frames) == 3
    assert frames[0].startswith(" 1/10 [==>...........................] - ETA: 0s - loss: 0.5000")
    assert frames[1].startswith(" 5/10 [==============>...............] - ETA:")
    # loss is not stateful: the mean per step, (0.5 * 5 + 0.25 * 5) / 10.
    assert frames[2] == "10/10 [==============================] - 0s 22ms/step - loss: 0.3750\n"
    assert text.endswith("\n") and text.count("\n") == 1


def test_tty_pads_a_shorter_line_over_the_previous_one(clock):
    out = FakeTTY()
    bar = Progbar(target=None, stream=out, stateful_metrics=["loss"])
    bar.update(1, {"loss": 123456.0})
    clock.now += 1
    bar.update(2, {"loss": 1.0})
    first, second = out.getvalue().split("\r")[1:]
    assert len(second) >= len(first)


def test_verbose_2_prints_one_keras_2_line(clock):
    out = io.StringIO()
    bar = Progbar(target=70, verbose=2, stream=out)
    for step in range(1, 71):
        clock.now += 0.02
        bar.update(step, [("loss", 2.27), ("accuracy", 0.22)])
    assert out.getvalue() == "70/70 - 1s - loss: 2.2700 - accuracy: 0.2200 - 1s/epoch - 20ms/step\n"


def test_value_formats_like_keras(clock):
    out = io.StringIO()
    bar = Progbar(target=1, stream=out, stateful_metrics=["tiny", "zero", "tensor"])
    bar.update(1, {"tiny": 0.0001, "zero": 0.0, "tensor": torch.tensor(0.5), "name": "adam"})
    text = out.getvalue()
    assert "tiny: 1.0000e-04" in text
    assert "zero: 0.0000e+00" in text
    assert "tensor: 0.5000" in text
    assert "name: adam" in text


def test_values_not_stateful_are_averaged_over_steps(clock):
    out = io.StringIO()
    bar = Progbar(target=4, stream=out, stateful_metrics=["acc"])
    bar.update(2, {"loss": 1.0, "acc": 0.1})
    bar.update(4, {"loss": 3.0, "acc": 0.9})
    assert "loss: 2.0000 - acc: 0.9000" in out.getvalue()


def test_unknown_target(clock):
    out = io.StringIO()
    bar = Progbar(target=None, stream=out)
    for step in range(1, 13):
        bar.update(step)
    bar.update(12, finalize=True)
    assert out.getvalue() == "     12/Unknown - 0s 0s/step\n"


def test_verbose_0_is_silent(clock):
    out = io.StringIO()
    bar = Progbar(target=3, verbose=0, stream=out)
    for step in range(1, 4):
        bar.update(step, {"loss": 1.0})
    assert out.getvalue() == ""


def test_invalid_arguments():
    with pytest.raises(ValueError, match=r"Invalid `verbose`.*verbose=3"):
        Progbar(target=3, verbose=3)
    with pytest.raises(ValueError, match="Invalid `count_mode`"):
        ProgbarLogger(count_mode="epochs")
    logger = ProgbarLogger()
    with pytest.raises(ValueError, match="verbose='auto'"):
        logger.set_params({"epochs": 1, "steps": 1, "verbose": "auto"})


def _fit(logger, epochs, steps, verbose, clock, with_validation=True):
    callbacks = CallbackList([logger], epochs=epochs, steps=steps, verbose=verbose)
    callbacks.on_train_begin()
    for epoch in range(epochs):
        callbacks.on_epoch_begin(epoch)
        for batch in range(3):
            clock.now += 0.01
            callbacks.on_train_batch_begin(batch)
            callbacks.on_train_batch_end(batch, {"loss": 1.0 / (batch + 1), "accuracy": 0.5})
        logs = {"loss": 0.3333, "accuracy": 0.5}
        if with_validation:
            callbacks.on_test_begin()
            callbacks.on_test_batch_end(0, {"loss": 9.0})
            callbacks.on_test_end({"loss": 0.25, "accuracy": 0.75})
            logs.update(val_loss=0.25, val_accuracy=0.75)
        callbacks.on_epoch_end(epoch, logs)
    callbacks.on_train_end()


def test_logger_verbose_1_on_a_file(clock):
    out = io.StringIO()
    _fit(ProgbarLogger(stream=out), epochs=2, steps=3, verbose=1, clock=clock)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == [
        "Epoch 1/2",
        "3/3 [==============================] - 0s 10ms/step - loss: 0.3333 - accuracy: 0.5000"
        " - val_loss: 0.2500 - val_accuracy: 0.7500",
        "Epoch 2/2",
        "3/3 [==============================] - 0s 10ms/step - loss: 0.3333 - accuracy: 0.5000"
        " - val_loss: 0.2500 - val_accuracy: 0.7500",
    ]


def test_logger_verbose_1_on_a_tty_uses_carriage_returns(clock):
    out = FakeTTY()
    _fit(ProgbarLogger(stream=out), epochs=1, steps=3, verbose=1, clock=clock)
    text = out.getvalue()
    assert "Epoch" not in text  # Keras prints it only for more than one epoch
    assert text.count("\r") == 2  # step 2 came 10 ms after step 1: throttled
    assert " - ETA: " in text
    assert text.endswith(" - val_loss: 0.2500 - val_accuracy: 0.7500\n")


def test_logger_verbose_2(clock):
    out = io.StringIO()
    _fit(ProgbarLogger(stream=out), epochs=2, steps=3, verbose=2, clock=clock)
    lines = out.getvalue().splitlines()
    assert lines[0] == "Epoch 1/2"
    assert lines[1] == (
        "3/3 - 0s - loss: 0.3333 - accuracy: 0.5000 - val_loss: 0.2500 - val_accuracy: 0.7500"
        " - 30ms/epoch - 10ms/step"
    )
    assert len(lines) == 4


def test_logger_verbose_0_prints_nothing(clock):
    out = io.StringIO()
    _fit(ProgbarLogger(stream=out), epochs=2, steps=3, verbose=0, clock=clock)
    assert out.getvalue() == ""


def test_logger_unknown_steps_learns_the_length(clock):
    out = io.StringIO()
    _fit(ProgbarLogger(stream=out), epochs=2, steps=None, verbose=1, clock=clock, with_validation=False)
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("3/3 [==============================] - 0s 10ms/step - loss: 0.3333")
    assert lines[3].startswith("3/3 [====")


def test_logger_for_evaluate_and_predict(clock):
    out = io.StringIO()
    callbacks = CallbackList([ProgbarLogger(stream=out)], epochs=1, steps=2, verbose=1)
    callbacks.on_test_begin()
    for batch in range(2):
        callbacks.on_test_batch_end(batch, {"loss": 0.5, "accuracy": 0.8})
    callbacks.on_test_end({"loss": 0.5, "accuracy": 0.8})
    callbacks.on_predict_begin()
    for batch in range(2):
        callbacks.on_predict_batch_end(batch, {"outputs": torch.zeros(4, 3)})
    callbacks.on_predict_end()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"2/2 \[=+\] - 0s 0s/step - loss: 0\.5000 - accuracy: 0\.8000", lines[0])
    assert re.fullmatch(r"2/2 \[=+\] - 0s 0s/step", lines[1])


def test_logger_file_interval_gives_step_rate_and_eta_lines_in_a_log(clock):
    out = io.StringIO()
    logger = ProgbarLogger(stream=out, file_interval=10)
    callbacks = CallbackList([logger], epochs=2, steps=40, verbose=1)
    callbacks.on_train_begin()
    for epoch in range(2):
        callbacks.on_epoch_begin(epoch)
        for batch in range(40):
            clock.now += 0.5
            callbacks.on_train_batch_end(batch, {"loss": 0.5})
        callbacks.on_epoch_end(epoch, {"loss": 0.5})
    callbacks.on_train_end()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # Per epoch: the header, a line at 10 s and 20 s (steps 20 and 40 would be the end), the final line.
    assert lines[:4] == ["Epoch 1/2",
                         "20/40 [" + "=" * 14 + ">" + "." * 15 + "] - ETA: 10s - 500ms/step - loss: 0.5000",
                         "40/40 [==============================] - 20s 500ms/step - loss: 0.5000",
                         "Epoch 2/2"]
    assert len(lines) == 6
    with pytest.raises(ValueError, match="Invalid `file_interval`"):
        ProgbarLogger(file_interval=0)


def test_a_terminal_forwarded_by_meshfit_launch_gets_the_live_bar(clock, monkeypatch, capsys):
    import sys

    monkeypatch.setenv(_progbar.FORWARDED_TERMINAL_ENV, "1")
    bar = Progbar(target=3, stream=sys.stdout)  # a pipe to the launcher, which forwards \r
    for step in range(1, 4):
        clock.now += 1.0
        bar.update(step, {"loss": 0.5})
    text = capsys.readouterr().out
    assert text.count("\r") == 3 and text.endswith("\n")
    monkeypatch.delenv(_progbar.FORWARDED_TERMINAL_ENV)
    bar = Progbar(target=3, stream=sys.stdout)
    for step in range(1, 4):
        clock.now += 1.0
        bar.update(step, {"loss": 0.5})
    assert "\r" not in capsys.readouterr().out
