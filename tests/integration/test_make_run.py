"""`make run` stops everything (Kafka, Redis, the supervisor and its pipeline process) on SIGINT or
SIGTERM to make's own process. make passes SIGTERM on to its recipe but not SIGINT; infra/run.sh watches
make for it. The run gets its own ports and state directory, so it does not touch a running `make run`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = (Path("/proc") / str(pid) / "status")
    return status.exists() and "State:\tZ" not in status.read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_make_stops_everything_make_run_started(tmp_path: Path, sig: signal.Signals) -> None:
    kafka_port, _, redis_port, bridge_port = free_ports(4)
    state = tmp_path / "state"
    env = {**os.environ, "SLUICE_KAFKA_PORT": str(kafka_port), "SLUICE_REDIS_PORT": str(redis_port),
           "SLUICE_BRIDGE_PORT": str(bridge_port), "SLUICE_RUN_STATE": str(state)}
    env.pop("SLUICE_CONFIG", None)
    log = (tmp_path / "make.log").open("wb")
    # -o setup: the environment is already set up; never reinstall it from a test
    # make as from a terminal, with SIGINT at its default: a test run started in the background by a
    # non-interactive shell (`cmd &`) can inherit SIGINT ignored, and make keeps an ignored SIGINT
    # ignored. A Python handler here is reset to the default in the child at exec; SIG_IGN would not be.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        make = subprocess.Popen(["make", "-s", "-o", "setup", "run"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and make.poll() is None:
            started |= descendants(make.pid)
            if any("--in-process" in cmdline(p) for p in started):
                break
            time.sleep(0.2)
        assert make.poll() is None, (tmp_path / "make.log").read_text()
        assert any("--in-process" in cmdline(p) for p in started), "the pipeline process did not start"
        services = [int((state / name).read_text()) for name in ("kafka.pid", "redis.pid")]
        assert all(alive(p) for p in services)
        started |= descendants(make.pid)
        make.send_signal(sig)
        make.wait(timeout=90)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(p) for p in (*started, *services)):
            time.sleep(0.2)
        left = {p: cmdline(p) for p in (*started, *services) if alive(p)}
        assert left == {}, left
        assert _free(kafka_port) and _free(redis_port) and _free(bridge_port)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
        subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=False)
        log.close()
