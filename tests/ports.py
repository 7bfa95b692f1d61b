"""Ports for the servers tests start, below Linux's ephemeral range (32768+).

A port picked by binding to 0 is an ephemeral one, which an outgoing connection of a busy test run can
take between the check and the server's bind (a fresh-clone CI run failed so in session 38). Ports are
never handed to two callers of one process."""

from __future__ import annotations

import random
import socket

_HANDED_OUT: set[int] = set()


def free_ports(n: int) -> list[int]:
    """n bindable ports in a row."""
    for _ in range(500):
        base = random.randrange(20_000, 32_000 - n)
        ports = [base + i for i in range(n)]
        if not _HANDED_OUT.intersection(ports) and all(bindable(p) for p in ports):
            _HANDED_OUT.update(ports)  # two calls before either binds must not get the same port
            return ports
    raise RuntimeError(f"no {n} free ports in a row")


def free_port() -> int:
    return free_ports(1)[0]


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
