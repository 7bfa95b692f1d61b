"""The guards, loaded once for the guard tests with the network cut off: any connection attempt or
DNS lookup during loading or checking fails the test session (the models must come from packages)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pipeline.guard.config import GuardSettings
from pipeline.guard.loader import InputGuard, output_guard
from pipeline.guard.stream_check import OutputGuard
from pipeline.settings import Settings


class NetworkUsed(AssertionError):
    pass


class NoNetwork:
    """Refuses DNS lookups and connections to anything but loopback, and records each attempt."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def __enter__(self) -> NoNetwork:
        self._mp = pytest.MonkeyPatch()
        real_connect = socket.socket.connect

        def connect(sock: socket.socket, address: object) -> None:
            host = address[0] if isinstance(address, tuple) else str(address)
            if sock.family == socket.AF_UNIX or host in ("127.0.0.1", "::1", "localhost"):
                return real_connect(sock, address)  # type: ignore[arg-type]
            self.attempts.append(f"connect {host}")
            raise NetworkUsed(f"connection to {host} attempted")

        def getaddrinfo(host: object, *args: object, **kwargs: object) -> list[object]:
            self.attempts.append(f"getaddrinfo {host}")
            raise NetworkUsed(f"DNS lookup of {host} attempted")

        self._mp.setattr(socket.socket, "connect", connect)
        self._mp.setattr(socket, "getaddrinfo", getaddrinfo)
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            self._mp.setenv(name, "1")
        return self

    def __exit__(self, *exc: object) -> None:
        self._mp.undo()


@pytest.fixture(scope="package")  # undone after the guard tests: the rest of the suite may resolve names
def no_network() -> Iterator[NoNetwork]:
    with NoNetwork() as guard:
        yield guard


@pytest.fixture(scope="package")  # undone after the guard tests: the rest of the suite may resolve names
def input_guard(no_network: NoNetwork) -> InputGuard:
    return InputGuard(GuardSettings(), Settings().model_cache)


@pytest.fixture(scope="package")  # undone after the guard tests: the rest of the suite may resolve names
def make_output_guard(no_network: NoNetwork):  # type: ignore[no-untyped-def]
    def make(**overrides: object) -> OutputGuard:
        return output_guard(GuardSettings(**overrides), Settings().model_cache)  # type: ignore[arg-type]

    return make
