"""Tests for meshfit._storage._io: atomic file writes and atomic directory replacement."""

from __future__ import annotations

import json
import os

import pytest

from meshfit._storage import _io
from meshfit._storage._io import atomic_directory, atomic_write_bytes, atomic_write_json, atomic_write_text


def _entries(directory):
    return sorted(os.listdir(directory))


def _tree(directory):
    out = {}
    for dirpath, _, files in os.walk(directory):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, directory)] = f.read()
    return out


def test_atomic_writes_create_and_replace_files(tmp_path):
    atomic_write_bytes(tmp_path / "a.bin", b"\x00\x01")
    atomic_write_bytes(tmp_path / "a.bin", b"new")
    atomic_write_text(str(tmp_path / "b.txt"), "héllo")
    atomic_write_json(tmp_path / "c.json", {"x": [1, 2.5, None], "y": "z"})
    assert (tmp_path / "a.bin").read_bytes() == b"new"
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "héllo"
    assert json.loads((tmp_path / "c.json").read_text()) == {"x": [1, 2.5, None], "y": "z"}
    assert _entries(tmp_path) == ["a.bin", "b.txt", "c.json"]  # no temp files left


def test_atomic_write_rejects_bad_input_and_writes_nothing(tmp_path):
    with pytest.raises(TypeError, match="str"):
        atomic_write_bytes(tmp_path / "a", "text")
    with pytest.raises(TypeError, match="text"):
        atomic_write_text(tmp_path / "a", b"bytes")
    with pytest.raises(TypeError, match="c.json"):
        atomic_write_json(tmp_path / "c.json", {"x": object()})
    with pytest.raises(FileNotFoundError, match="missing"):
        atomic_write_bytes(tmp_path / "missing" / "a", b"x")
    assert _entries(tmp_path) == []


def test_failed_file_write_keeps_previous_content(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    atomic_write_json(target, {"step": 1})

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(_io.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_json(target, {"step": 2})
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"step": 1}
    assert _entries(tmp_path) == ["state.json"]


def test_atomic_directory_creates_and_replaces(tmp_path):
    target = tmp_path / "sub" / "ckpt"
    with atomic_directory(target) as tmp:
        assert tmp == f"{target}.tmp-{os.getpid()}"
        assert not target.exists()
        atomic_write_text(os.path.join(tmp, "a.txt"), "one")
        os.makedirs(os.path.join(tmp, "inner"))
        atomic_write_text(os.path.join(tmp, "inner", "b.txt"), "two")
    assert _tree(target) == {"a.txt": b"one", os.path.join("inner", "b.txt"): b"two"}
    with atomic_directory(str(target)) as tmp:
        atomic_write_text(os.path.join(tmp, "c.txt"), "three")
    assert _tree(target) == {"c.txt": b"three"}
    assert _entries(target.parent) == ["ckpt"]


def test_exception_inside_leaves_previous_directory_intact(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        atomic_write_text(os.path.join(tmp, "a.txt"), "old")
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(target) as tmp:
        atomic_write_text(os.path.join(tmp, "a.txt"), "new")
        atomic_write_text(os.path.join(tmp, "partial.txt"), "half")
        raise RuntimeError("boom")
    assert _tree(target) == {"a.txt": b"old"}
    assert _entries(tmp_path) == ["ckpt"]


def test_exception_with_no_previous_directory_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt), atomic_directory(tmp_path / "ckpt") as tmp:
        atomic_write_text(os.path.join(tmp, "a.txt"), "x")
        raise KeyboardInterrupt
    assert _entries(tmp_path) == []


def test_crash_leftovers_do_not_affect_the_target(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        atomic_write_text(os.path.join(tmp, "a.txt"), "good")
    # A process killed mid-save leaves its temp dir behind (here from another pid and from ours).
    for pid in (999999, os.getpid()):
        stale = tmp_path / f"ckpt.tmp-{pid}"
        stale.mkdir()
        (stale / "a.txt").write_text("partial")
    assert _tree(target) == {"a.txt": b"good"}
    with atomic_directory(target) as tmp:
        assert _entries(tmp) == []  # our own pid's stale temp dir was cleared first
        atomic_write_text(os.path.join(tmp, "a.txt"), "newer")
    assert _tree(target) == {"a.txt": b"newer"}
    assert _entries(tmp_path) == ["ckpt", "ckpt.tmp-999999"]


def test_failed_rename_into_place_restores_previous_directory(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        atomic_write_text(os.path.join(tmp, "a.txt"), "old")
    real_replace = os.replace

    def flaky_replace(src, dst):
        if ".tmp-" in os.fspath(src):
            raise OSError("rename failed")
        return real_replace(src, dst)

    monkeypatch.setattr(_io.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="rename failed"), atomic_directory(target) as tmp:
        with open(os.path.join(tmp, "a.txt"), "w") as f:  # plain write: os.replace is patched
            f.write("new")
    monkeypatch.undo()
    assert _tree(target) == {"a.txt": b"old"}
    assert _entries(tmp_path) == ["ckpt"]


@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="no O_TMPFILE on this platform: the file is named, then marked")
def test_an_atomic_files_writer_is_recorded_before_its_scratch_name_exists(tmp_path, monkeypatch):
    # Created unnamed (O_TMPFILE), marked, then linked: no moment exists at which a kill leaves a scratch
    # file whose writer is unknown (a clean-up may never remove such a file). The link once failed here
    # (EXDEV) and every file fell back to being named first.
    seen: list[list[str]] = []
    mark = _io.mark_writer

    def spy(target):
        seen.append(sorted(os.listdir(tmp_path)))
        mark(target)

    monkeypatch.setattr(_io, "mark_writer", spy)
    atomic_write_bytes(tmp_path / "record", b"x")
    assert seen == [[]], seen  # marked once, while no name existed
    assert (tmp_path / "record").read_bytes() == b"x" and os.listdir(tmp_path) == ["record"]
