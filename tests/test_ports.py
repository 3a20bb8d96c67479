"""meshfit._runtime._ports: the ports `meshfit launch` and MirroredStrategy put in a worker's address."""

from __future__ import annotations

import random
import socket

import pytest

from meshfit._runtime import _ports, free_ports


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(_ports.ephemeral_low() is None, reason="no ip_local_port_range to read (not Linux)")
def test_ports_come_from_below_the_ephemeral_range_where_no_connection_takes_one():
    low = _ports.ephemeral_low()
    for _ in range(20):
        ports = free_ports(4)
        assert len(set(ports)) == 4, ports
        assert all(low // 2 <= p < low for p in ports), (ports, low)  # never an outgoing connection's source port
        assert all(_bindable(p) for p in ports)


@pytest.mark.skipif(_ports.ephemeral_low() is None, reason="no ip_local_port_range to read (not Linux)")
def test_a_port_in_use_is_never_returned(monkeypatch):
    low = _ports.ephemeral_low()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        for port in range(low // 2, low):  # a port of the range, taken
            try:
                held.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        taken = held.getsockname()[1]

        class TakenFirst(random.Random):  # the held port is the first candidate
            def sample(self, population, k, **kwargs):
                return [taken, *(p for p in super().sample(population, k) if p != taken)][:k]

        monkeypatch.setattr(_ports.random, "Random", TakenFirst)
        ports = free_ports(3)
    assert taken not in ports and len(set(ports)) == 3, (taken, ports)


def test_without_the_range_the_os_picks(monkeypatch):
    monkeypatch.setattr(_ports, "ephemeral_low", lambda: None)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(_bindable(p) for p in ports)


def test_picking_ports_leaves_the_users_random_state_alone():
    random.seed(7)
    want = random.random()
    random.seed(7)
    free_ports(2)
    assert random.random() == want
