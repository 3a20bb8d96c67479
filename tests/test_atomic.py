"""meshfit._storage._atomic: one atomic-directory mechanism for models and checkpoints; crash recovery; leftovers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import torch

import meshfit as mf
from meshfit._storage import _atomic, _io
from meshfit._storage._atomic import (
    _WRITER_ATTRIBUTE,
    AtomicDirectory,
    clean_directory,
    clean_siblings,
    is_scratch_name,
    recover,
    remove_tree,
)
from meshfit.train import Checkpoint, CheckpointManager, latest_checkpoint
from tests import _procs
from tests._trackables import Position


def _crash_between_renames() -> None:
    """From here on, the rename of a scratch directory into place kills the process (kill -9 timing)."""
    real_replace = os.replace

    def replace(src, dst):
        if ".tmp" in os.path.basename(os.fspath(src)) and os.path.isdir(src):
            os._exit(17)
        return real_replace(src, dst)

    os.replace = replace


def _save_model_twice_and_crash(path: str) -> None:
    torch.manual_seed(0)
    model = mf.Model(torch.nn.Linear(2, 1))
    model.compile("sgd", "mse")
    with torch.no_grad():
        model.module.weight.fill_(1.0)
    model.save(path)
    with torch.no_grad():
        model.module.weight.fill_(2.0)
    _crash_between_renames()
    model.save(path)


def _save_checkpoint_twice_and_crash(directory: str) -> None:
    position = Position(1)
    checkpoint = Checkpoint(p=position, w=torch.ones(2))
    checkpoint.save(os.path.join(directory, "ckpt-1"))
    position.value = 2
    _crash_between_renames()
    checkpoint.save(os.path.join(directory, "ckpt-1"))  # a replacing save: the old ckpt-1 is moved aside first


def _run(target, *args) -> None:
    assert _procs.exit_code_of(target, *args, timeout=120) == 17


def test_model_save_crash_between_the_two_renames_is_recovered_by_load_model(tmp_path):
    path = str(tmp_path / "model")
    _run(_save_model_twice_and_crash, path)
    names = sorted(os.listdir(tmp_path))
    assert "model" not in names and any(n.startswith("model.old-") for n in names), names
    model = mf.load_model(path)  # the previous copy is put back
    assert torch.equal(model.module.weight, torch.ones(1, 2))
    assert "model" in os.listdir(tmp_path)
    model.save(path)  # a later save cleans the dead writer's scratch copy
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_model_save_crash_is_recovered_by_the_next_save(tmp_path):
    path = str(tmp_path / "model")
    _run(_save_model_twice_and_crash, path)
    model = mf.Model(torch.nn.Linear(2, 1))
    model.compile("sgd", "mse")
    with torch.no_grad():
        model.module.weight.fill_(3.0)
    model.save(path)
    assert sorted(os.listdir(tmp_path)) == ["model"]
    assert torch.equal(mf.load_model(path).module.weight, torch.full((1, 2), 3.0))


def test_checkpoint_crash_between_the_two_renames_is_recovered_by_latest_checkpoint(tmp_path):
    _run(_save_checkpoint_twice_and_crash, str(tmp_path))
    assert "ckpt-1" not in os.listdir(tmp_path)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")
    position = Position()
    Checkpoint(p=position, w=torch.zeros(2)).restore(latest_checkpoint(tmp_path))
    assert position.value == 1  # the last completed save, not the interrupted one
    manager = CheckpointManager(Checkpoint(p=position, w=torch.zeros(2)), tmp_path)
    manager.save()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1", "ckpt-2"]  # dead leftovers cleaned
    assert manager.checkpoints == [str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-2")]


def test_checkpoint_crash_is_recovered_by_the_next_save_of_the_same_path(tmp_path):
    _run(_save_checkpoint_twice_and_crash, str(tmp_path))
    position = Position(5)
    Checkpoint(p=position, w=torch.zeros(2)).save(tmp_path / "ckpt-1")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1"]
    position.value = 0
    Checkpoint(p=position, w=torch.zeros(2)).restore(tmp_path / "ckpt-1")
    assert position.value == 5


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_dead_writers_leftovers_are_removed_and_a_live_writers_scratch_is_kept(tmp_path):
    done = AtomicDirectory(tmp_path / "a")
    with done.writing() as scratch:
        (tmp_path / "a.payload").write_text("x")
        os.rename(tmp_path / "a.payload", os.path.join(scratch, "payload"))
    live = AtomicDirectory(tmp_path / "b")  # this process: alive, still writing
    live_scratch = live.create()
    dead = AtomicDirectory(tmp_path / "c", scratch=tmp_path / "c.tmp")
    dead_scratch = dead.create()
    os.setxattr(dead_scratch, "user.meshfit.writer", f'{{"host": "{os.uname().nodename}", "pid": {_dead_pid()}}}'
                .encode())
    foreign = AtomicDirectory(tmp_path / "d", scratch=tmp_path / "d.tmp")
    foreign_scratch = foreign.create()
    os.setxattr(foreign_scratch, "user.meshfit.writer", b'{"host": "another-host", "pid": 1}')
    (tmp_path / "a.deleting-123").mkdir()
    (tmp_path / "a.old-123").mkdir()  # left behind after its replacement was in place
    (tmp_path / "user.tmp").mkdir()  # a user's folder: no recorded meshfit writer
    (tmp_path / "user.old").mkdir()
    clean_directory(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["a", f"b.tmp-{os.getpid()}", "d.tmp", "user.old", "user.tmp"]
    live.finalize()
    assert os.path.isdir(tmp_path / "b") and not os.path.exists(live_scratch)


def test_a_tree_this_process_is_still_unlinking_is_left_to_its_thread(tmp_path, monkeypatch):
    release = threading.Event()
    started = threading.Event()
    rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        started.set()
        release.wait(timeout=30)
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(_atomic.shutil, "rmtree", slow_rmtree)
    (tmp_path / "a" / "b").mkdir(parents=True)
    remove_tree(str(tmp_path / "a"), background=True)
    doomed = tmp_path / f"a.deleting-{os.getpid()}"
    assert started.wait(timeout=30)
    monkeypatch.setattr(_atomic.shutil, "rmtree", rmtree)  # a second remover would unlink at once
    clean_siblings(tmp_path / "a")
    assert os.listdir(tmp_path) == [doomed.name]  # not raced by a second remover
    release.set()
    for thread in [t for t in threading.enumerate() if t.name == "meshfit-prune"]:
        thread.join(timeout=30)
    assert os.listdir(tmp_path) == []
    (doomed / "c").mkdir(parents=True)  # the same name, left by a killed process that had this pid
    clean_siblings(tmp_path / "a")
    assert os.listdir(tmp_path) == []


def test_a_writer_that_exited_but_was_not_yet_reaped_counts_as_dead(tmp_path):
    # A zombie (its parent has not waited for it yet, as a launcher between a worker's death and its
    # wait) can write nothing: its scratch copy is a leftover like any dead writer's.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert _procs.wait_until(lambda: not _procs.pid_alive(child.pid), timeout=30)  # exited, not reaped
        zombie = AtomicDirectory(tmp_path / "z", scratch=tmp_path / "z.tmp")
        scratch = zombie.create()
        os.setxattr(scratch, _WRITER_ATTRIBUTE, f'{{"host": "{os.uname().nodename}", "pid": {child.pid}}}'.encode())
        clean_directory(tmp_path)
        assert os.listdir(tmp_path) == []
    finally:
        child.wait(timeout=30)


def test_recover_waits_for_a_live_swap_and_names_are_recognised(tmp_path):
    assert recover(tmp_path / "absent") is False
    for name in ("x.tmp", "x.tmp-12", "x.old-12", "x.deleting-3", "ckpt-4.tmp"):
        assert is_scratch_name(name), name
    for name in ("x", "ckpt-4", "x.tmpl", "model.safetensors"):
        assert not is_scratch_name(name), name


def test_a_writer_stalled_mid_swap_retries_after_a_reader_put_the_old_copy_back(tmp_path, monkeypatch):
    from meshfit._storage import _atomic

    target = tmp_path / "m"
    with AtomicDirectory(target).writing() as scratch:
        with open(os.path.join(scratch, "v"), "w") as f:
            f.write("1")
    monkeypatch.setattr(_atomic, "_SWAP_GRACE_SECONDS", 0.0)
    real_replace, stalled = os.replace, []

    def replace(src, dst):
        real_replace(src, dst)
        if ".old-" in os.fspath(dst) and not stalled:  # the writer stalls right after moving the old copy aside
            stalled.append(True)
            assert recover(target)  # a reader finds no copy for its whole grace period and puts it back

    monkeypatch.setattr(os, "replace", replace)
    with AtomicDirectory(target).writing() as scratch:
        with open(os.path.join(scratch, "v"), "w") as f:
            f.write("2")
    monkeypatch.undo()
    assert stalled and (target / "v").read_text() == "2"
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_an_atomic_files_scratch_name_appears_with_its_writer_already_recorded(tmp_path, monkeypatch):
    """A kill between creating ``<name>.tmp-<pid>`` and recording its writer would leave a file no clean-up
    may remove (a name alone proves nothing): the name appears only once the file is marked."""
    seen: list[bytes] = []
    original = os.link

    def link(source, destination, *args, **kwargs):
        seen.append(os.getxattr(source, _WRITER_ATTRIBUTE))  # the unnamed file, before it gets its name
        return original(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    target = tmp_path / "checkpoint"
    _io.atomic_write_text(target, "model_checkpoint_path: ckpt-1\n")
    assert target.read_text() == "model_checkpoint_path: ckpt-1\n" and os.listdir(tmp_path) == ["checkpoint"]
    assert len(seen) == 1 and f'"pid": {os.getpid()}' in seen[0].decode()
