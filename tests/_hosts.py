"""Hosts for multi-host tests: network namespaces joined by a bridge, with private test addresses.

``namespace_hosts`` is a pytest fixture factory (import ``namespace_hosts_fixture`` into the test
module): ``hosts = namespace_hosts(2)`` creates the namespaces ``<tag>h0``, ``<tag>h1``
(``hosts.ip(i)`` = ``10.213.<n>.<i+1>``, a /24 used only inside them), each with loopback up and one
end of a veth pair whose other end joins a bridge in the root namespace. The root namespace gets no
address on that bridge, so traffic stays inside the namespaces. ``hosts.start(i, argv, env)`` runs
``python argv`` "on" host ``i`` (a Python script forked from the warm interpreter into the host's
namespace; another program under ``ip netns exec``); ``hosts.cut(i)`` / ``hosts.restore(i)`` take
host ``i``'s link down and up. Everything — processes, namespaces, veths, the bridge — is removed after
the test, failed or not. Without permission to create namespaces (not root, or a sandbox), the test is
skipped and the reason printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

import _warm
import pytest

SUBNET = "10.213"  # 10.213.<n>.0/24: only ever used inside the namespaces created here
NETNS_DIR = "/var/run/netns"  # where `ip netns add` names a namespace


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or ``None`` when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    probe = f"mfprobe{os.getpid()}"
    try:
        result = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return f"`ip netns add` cannot run here: {error}"
    if result.returncode != 0:
        return f"`ip netns add` is not permitted here: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """N namespace hosts on one bridge (see the module docstring)."""

    def __init__(self, count: int) -> None:
        self.tag = f"mf{os.getpid() % 100000}"
        self.subnet = f"{SUBNET}.{os.getpid() % 200 + 20}"
        self.count = count
        self.bridge = f"{self.tag}br"
        self.procs: list[subprocess.Popen | _warm.WarmProcess] = []
        self._made: list[Callable[[], None]] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(lambda: _ip("link", "del", self.bridge, check=False))
        _ip("link", "set", self.bridge, "up")
        for i in range(self.count):
            ns, outer = self.namespace(i), self.link(i)
            _ip("netns", "add", ns)
            self._made.append(lambda ns=ns: _ip("netns", "del", ns, check=False))
            _ip("link", "add", outer, "type", "veth", "peer", "name", f"{self.tag}p{i}")
            self._made.append(lambda outer=outer: _ip("link", "del", outer, check=False))
            _ip("link", "set", f"{self.tag}p{i}", "netns", ns)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("-n", ns, "link", "set", f"{self.tag}p{i}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def namespace(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def link(self, i: int) -> str:
        """Host ``i``'s end of its cable, on the bridge."""
        return f"{self.tag}v{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def start(self, i: int, argv: Sequence[str], env: Mapping[str, str], program: str = sys.executable,
              ) -> subprocess.Popen | _warm.WarmProcess:
        """Run ``program argv...`` on host ``i`` in its own session; output captured as text.

        A Python script is forked from this pytest worker's warm interpreter (tests/_warm.py), which moves
        it into the host's namespace before its first line: what runs on the host is the same script with
        the same argv and environment, without 4-5 s of CPU importing torch again. Anything else (torchrun,
        ``-m``) runs under ``ip netns exec`` as a new process.
        """
        proc: subprocess.Popen | _warm.WarmProcess
        if program == sys.executable and _warm.can_start(argv, dict(env)):
            proc = _warm.start(argv, dict(env), netns=os.path.join(NETNS_DIR, self.namespace(i)))
        else:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(i), program, *argv], env=dict(env),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a command on host ``i`` and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(i), *argv], capture_output=True,
                              text=True, timeout=timeout)

    def cut(self, i: int) -> None:
        _ip("link", "set", self.link(i), "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.link(i), "up")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        for undo in reversed(self._made):
            undo()


@pytest.fixture(name="namespace_hosts")
def namespace_hosts_fixture() -> Iterator[Callable[[int], Hosts]]:
    """A factory of namespace hosts, removed after the test (skipped where namespaces are not permitted)."""
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"skipping: {reason}")
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(count: int) -> Hosts:
        hosts = Hosts(count)
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.close()
