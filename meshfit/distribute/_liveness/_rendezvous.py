"""Forming the process group: a rendezvous store bound to the configured address, and start checks.

Rank 0 (the chief) hosts a ``torch.distributed.TCPStore`` listening only on the address the cluster
names for it (``TF_CONFIG``'s first training task, ``MASTER_ADDR``), never on every interface; the
others connect to it, saying every few seconds whom they are waiting for, where, and for how long.
Before any collective, every worker posts the settings that must agree (world size, cluster list,
backend, timeouts) and compares them with rank 0's: a mismatch, or two workers claiming one rank,
fails at once, naming the setting and each worker's value, instead of after the collective timeout.

gloo is told to use the network interface that holds this worker's address (``GLOO_SOCKET_IFNAME``,
unless the user set it), so its listeners bind that address only. Every group creation gets
meshfit's configured timeout (`World.new_group`), never torch's 30-minute default.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshfit._protocols import DistributionStrategy

_KEY = "meshfit/rendezvous"
_WAIT_MESSAGE_EVERY = 5.0
_PROBE_SECONDS = 5.0  # how long a worker that found rank 0's address taken looks for this job's rank 0 there
_SIOCGIFADDR = 0x8915


class ClusterMismatchError(ValueError):
    """Workers of one job were started with settings that must agree but do not."""


# ---- addresses and interfaces ------------------------------------------------------------------
def resolve(host: str, what: str) -> str:
    """The IP address of ``host``; a clear error naming ``what`` when it does not resolve."""
    try:
        return str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except (socket.gaierror, UnicodeError) as error:
        raise ValueError(f"{what} names host {host!r}, which does not resolve on this machine ({error}). "
                         "Use an IP address or a host name that resolves here.") from None


def interface_holding(ip: str) -> str | None:
    """The name of this machine's network interface that holds ``ip``, if any."""
    address = ipaddress.ip_address(ip)
    if address.is_loopback:
        return "lo"
    if address.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if ipaddress.ip_address(int(fields[0], 16)) == address:
                        return fields[-1]
        except OSError:
            return None
        return None
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(bytes(answer[20:24])) == ip:
                return name
    finally:
        probe.close()
    return None


def route_source(peer_ip: str) -> str | None:
    """The local address this machine would use to reach ``peer_ip`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in peer_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer_ip, 9))
            return probe.getsockname()[0]
        except OSError:
            return None


def use_interface_of(own_ip: str | None, master_ip: str) -> str | None:
    """Point gloo at the interface holding this worker's address (else the one routing to rank 0).

    Returns the interface name set, or ``None`` when the user chose one (``GLOO_SOCKET_IFNAME``) or
    none could be found (gloo then picks its default).
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    name = interface_holding(own_ip) if own_ip else None
    if name is None:
        source = route_source(master_ip)
        name = interface_holding(source) if source else None
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


# ---- the store --------------------------------------------------------------------------------
def host_store(ip: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store, listening on ``ip:port`` only."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((ip, port))
        listener.listen(1024)
    except OSError as error:
        listener.close()
        raise OSError(error.errno, f"meshfit: rank 0 cannot listen on {_endpoint(ip, port)} for the rendezvous "
                      f"({error.strerror}). Is that address this machine's, and the port free?") from None
    # The store owns the listening socket from here on.
    return dist.TCPStore(ip, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def connect_store(ip: str, port: int, world_size: int, timeout: timedelta, who: str, whom: str) -> dist.TCPStore:
    """A client of rank 0's store; says every few seconds that it is still waiting, and for whom."""
    started = time.monotonic()
    total = timeout.total_seconds()
    while True:
        left = total - (time.monotonic() - started)
        try:
            return dist.TCPStore(ip, port, world_size, False,
                                 timedelta(seconds=max(0.5, min(_WAIT_MESSAGE_EVERY, left))))
        except (dist.DistError, RuntimeError, OSError) as error:
            waited = time.monotonic() - started
            if waited >= total:
                raise TimeoutError(f"meshfit: {who} could not reach {whom} at {_endpoint(ip, port)} within "
                                   f"{total:g} s ({error}). Check that it runs and that this address is "
                                   "reachable from here.") from None
            _say(f"{who} is waiting for {whom} at {_endpoint(ip, port)} ({waited:.0f} s of {total:g} s)")
            time.sleep(0.2)


def client_for(store: Any, timeout: timedelta) -> Any:
    """A second connection to ``store``'s server with its own ``timeout`` (else ``store`` itself).

    The watchdog uses it: a store client serialises its requests, so sharing one with a thread blocked
    in a rendezvous would block the watchdog too.
    """
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        return dist.TCPStore(inner.host, inner.port, None, False, timeout)
    return store


def form_rendezvous(rank: int, world_size: int, master: tuple[str, int], own_host: str | None, backend: str,
                    timeout: timedelta, names: list[str], settings: Mapping[str, Any]
                    ) -> tuple[Any, bool, list[str]]:
    """Open the rendezvous store (hosting it on rank 0) and check the workers agree.

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent already hosts the store at
    ``master`` and every worker is a client. A worker whose address the cluster does not list
    (``own_host`` None: torchrun's or SLURM's variables name rank 0 only) tells the others where it
    runs, so that messages about it name its machine, as they do under ``TF_CONFIG``.

    Returns:
        ``(store, hosting, names)``: the store for ``init_process_group(store=...)``, whether this
        process hosts it, and each rank's description completed with its address.
    """
    host, port = master
    master_ip = resolve(host, f"The rendezvous address of rank 0 ({names[0]})")
    own_ip = resolve(own_host, f"This worker's address ({names[rank]})") if own_host else None
    if backend == "gloo":
        use_interface_of(own_ip, master_ip)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosting = rank == 0 and not agent
    store: dist.Store
    if hosting:
        try:
            store = host_store(master_ip, port, world_size, timeout)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                _refuse_a_second_rank_0(master_ip, port, world_size, settings, names)
            raise
    else:
        whom = "torchrun's rendezvous store" if agent else f"{names[0]}, which hosts the rendezvous store"
        store = connect_store(master_ip, port, world_size, timeout, names[rank], whom)
    if agent:  # the agent's store outlives restarts: keep each round's keys apart
        store = dist.PrefixStore(f"meshfit/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    mine = names[rank] if own_host else f"{names[rank]} at {_whereabouts(master_ip)}"
    store.set(f"{_KEY}/names/{rank}", mine)  # before the settings: a peer that read those finds it
    agree_at_start(store, rank, world_size, {**settings, "world_size": world_size,
                                             "rendezvous": _endpoint(host, port)}, names, timeout)
    described = [mine if r == rank else store.get(f"{_KEY}/names/{r}").decode(errors="replace")[:200]
                 for r in range(world_size)]
    return store, hosting, described


def _whereabouts(master_ip: str) -> str:
    """This worker's address as rank 0 sees it (the source of the route to it), host name and pid."""
    ip = route_source(master_ip) or "?"
    return f"{ip} ({socket.gethostname()}, pid {os.getpid()})"


def _refuse_a_second_rank_0(ip: str, port: int, world_size: int, settings: Mapping[str, Any],
                            names: list[str]) -> None:
    """Rank 0's address is taken: if by this job's rank 0 (two workers given its index), say so to both.

    The address holds a meshfit rendezvous of this cluster when its rank 0 posted the same list of
    training tasks; then this worker posts the abort that rank 0 and the others read while they wait,
    and raises. Anything else (another program, another job) returns: the caller reports the port.
    """
    try:
        store = dist.TCPStore(ip, port, world_size, False, timedelta(seconds=_PROBE_SECONDS))
        store.wait([f"{_KEY}/settings/0"], timedelta(seconds=_PROBE_SECONDS))
        theirs = json.loads(store.get(f"{_KEY}/settings/0"))
    except (dist.DistError, RuntimeError, OSError, ValueError):
        return
    if theirs.get("training_tasks") != settings.get("training_tasks") or theirs.get("world_size") != world_size:
        return
    _abort(store, f"two workers were started as rank 0 ({names[0]}): each task needs its own task index in "
                  "TF_CONFIG (or RANK)")


def store_host_rank(store: Any, hosting: bool) -> int | None:
    """The rank whose process hosts ``store`` (``None``: another process, e.g. torchrun's agent)."""
    if hosting:
        return 0
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    return 0


def agree_on_settings(strategy: DistributionStrategy, settings: Mapping[str, object], what: str) -> None:
    """Check that every replica passed the same ``settings``; else fail at once on every replica.

    One small all-gather; call it on every replica at the same point, before the collectives that
    would otherwise hang or fail obscurely on a mismatch (e.g. ``steps_per_epoch`` in ``fit``).

    Args:
        strategy: the strategy whose replicas must agree.
        settings: name -> value (compared with ``==`` after a round trip through pickle).
        what: what the settings configure, for the message (e.g. ``"fit"``).

    Raises:
        ClusterMismatchError: a setting differs; the message names it and each worker's value.
    """
    values = strategy.all_gather_object(dict(settings))
    differences = []
    for name in settings:
        per_rank = [v.get(name) for v in values]
        if any(v != per_rank[0] for v in per_rank[1:]):
            differences.append(f"{name}: " + ", ".join(f"worker {r} has {v!r}" for r, v in enumerate(per_rank)))
    if differences:
        raise ClusterMismatchError(f"The workers called {what} with different settings, which must be equal on "
                                   "every worker: " + "; ".join(differences) + ". Pass the same values everywhere.")


# ---- agreeing on settings before the first collective ----------------------------------------
def agree_at_start(store: Any, rank: int, world_size: int, settings: Mapping[str, Any], names: list[str],
                   timeout: timedelta) -> None:
    """Post this worker's ``settings``; compare them with every other worker's; fail on a mismatch.

    Args:
        store: the rendezvous store.
        rank: this worker's rank.
        world_size: the number of workers this worker expects.
        settings: JSON-serialisable values that must be equal on every worker.
        names: a description of each rank (for messages).
        timeout: how long to wait for the others.

    Raises:
        ClusterMismatchError: a setting differs, two workers claim the same rank, or the store went away
            (its host stopped the start).
        TimeoutError: a worker did not join within ``timeout``.
    """
    try:
        _agree(store, rank, world_size, settings, names, timeout)
    except dist.DistNetworkError as error:  # the store's host ended (it names why in its own output)
        raise ClusterMismatchError(f"meshfit: another worker stopped the start: the rendezvous store went away "
                                   f"while {names[rank]} compared settings with the others "
                                   f"({type(error).__name__}). The worker that stopped first names the reason "
                                   "in its output.") from None


def _agree(store: Any, rank: int, world_size: int, settings: Mapping[str, Any], names: list[str],
           timeout: timedelta) -> None:
    mine = json.dumps(dict(settings), sort_keys=True, default=str)
    if store.add(f"{_KEY}/claims/{rank}", 1) > 1:
        _abort(store, f"two workers were started as rank {rank} ({names[rank]}): each task needs its own "
                      "task index in TF_CONFIG (or RANK)")
    store.set(f"{_KEY}/settings/{rank}", mine)
    started = time.monotonic()
    total = timeout.total_seconds()
    last_message = started
    for peer in [0] + [r for r in range(1, world_size) if r != rank]:
        if peer == rank:
            continue
        key = f"{_KEY}/settings/{peer}"
        while True:
            _check_abort(store)
            try:
                store.wait([key], timedelta(seconds=0.5))
                break
            except dist.DistNetworkError:
                raise
            except (dist.DistError, RuntimeError):
                waited = time.monotonic() - started
                if waited >= total:
                    raise TimeoutError(f"meshfit: {names[rank]} waited {total:g} s for {names[peer]} to join; it "
                                       "never did. Check that it was started and can reach rank 0.") from None
                if time.monotonic() - last_message >= _WAIT_MESSAGE_EVERY:
                    last_message = time.monotonic()
                    _say(f"{names[rank]} is waiting for {names[peer]} to join ({waited:.0f} s of {total:g} s)")
        theirs = json.loads(store.get(key))
        differences = [f"{name}: {names[rank]} has {settings_value!r}, {names[peer]} has {theirs.get(name)!r}"
                       for name, settings_value in json.loads(mine).items() if theirs.get(name) != settings_value]
        if differences:
            _abort(store, "workers disagree on settings that must be equal on every worker: "
                          + "; ".join(differences))


def _abort(store: Any, message: str) -> None:
    store.set(f"{_KEY}/abort", message)
    raise ClusterMismatchError(f"meshfit: {message}.")


def _check_abort(store: Any) -> None:
    if store.check([f"{_KEY}/abort"]):
        message = store.get(f"{_KEY}/abort").decode(errors="replace")
        raise ClusterMismatchError(f"meshfit: another worker stopped the start: {message}.")


def _say(message: str) -> None:
    print(f"meshfit: {message}", file=sys.stderr, flush=True)


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
