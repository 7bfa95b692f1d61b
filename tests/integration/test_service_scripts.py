"""The service scripts in infra/: a second `make run` on a state directory is refused before it can stop
the first one's services; Redis's files are private in every profile; a start whose server exits fails
at once with its log; Triton and Prometheus refuse a port another process holds (that process would
answer their readiness checks)."""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import free_port, free_ports

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _run(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def redis_state(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    state, port = tmp_path / "state", free_port()
    try:
        yield state, port
    finally:
        _run(ROOT / "infra" / "services.sh", "stop", state)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_second_run_on_a_state_directory_is_refused_and_stops_nothing(redis_state: tuple[Path, int]) -> None:
    state, redis_port = redis_state
    assert _run(ROOT / "infra" / "redis" / "start.sh", state, redis_port).returncode == 0
    redis_pid = int((state / "redis.pid").read_text())
    kafka_port = free_ports(2)[0]
    with (state / "run.lock").open("a") as lock:  # what the first run holds for its life
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        second = _run("bash", ROOT / "infra" / "run.sh", env={
            "SLUICE_RUN_STATE": str(state), "SLUICE_KAFKA_PORT": str(kafka_port), "SLUICE_REDIS_PORT": str(redis_port)})
    assert second.returncode == 1
    assert "another run is using" in second.stderr
    assert _alive(redis_pid) and (state / "redis.pid").exists()  # the first run's Redis is untouched
    assert not (state / "kafka.pid").exists()  # and nothing was started


def test_redis_files_are_private_in_the_default_profile_and_older_ones_are_made_private(redis_state: tuple[Path, int]) -> None:
    state, port = redis_state
    start = ROOT / "infra" / "redis" / "start.sh"
    assert _run(start, state, port).returncode == 0
    assert _run(ROOT / "infra" / "services.sh", "stop", state).returncode == 0
    aof = state / "appendonlydir"
    made = [aof, *aof.iterdir(), state / "redis.log"]
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in made)
    for path in made:  # as a start before umask 077 left them
        path.chmod(0o755 if path.is_dir() else 0o644)
    assert _run(start, state, port).returncode == 0
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in [aof, *aof.iterdir(), state / "redis.log"])


def test_a_redis_that_exits_while_loading_fails_its_start_at_once_with_its_log(redis_state: tuple[Path, int]) -> None:
    state, port = redis_state
    start = ROOT / "infra" / "redis" / "start.sh"
    assert _run(start, state, port).returncode == 0
    assert _run(ROOT / "infra" / "services.sh", "stop", state).returncode == 0
    [incr] = (state / "appendonlydir").glob("*.incr.aof")
    incr.write_bytes(b"garbage\r\n")  # Redis refuses the append-only file and exits
    failed = _run(start, state, port)
    assert failed.returncode == 1
    assert "Redis exited" in failed.stderr and "Bad file format" in failed.stderr


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_prometheus_refuses_a_port_another_process_holds(tmp_path: Path, taken_port: int) -> None:
    started = _run(ROOT / "infra" / "observe.sh", "start", tmp_path, env={
        "SLUICE_PROMETHEUS_PORT": str(taken_port), "SLUICE_PHOENIX_PORT": str(free_ports(2)[0])})
    assert started.returncode == 1
    assert f"port {taken_port} is in use" in started.stderr
    assert not (tmp_path / "prometheus.pid").exists() and not (tmp_path / "phoenix.pid").exists()


@pytest.mark.skipif(not (ROOT / ".venv-triton" / ".installed").exists(), reason="make setup builds .venv-triton")
def test_triton_refuses_a_port_another_process_holds(tmp_path: Path, taken_port: int) -> None:
    started = _run(ROOT / "infra" / "triton" / "triton.sh", "start", tmp_path, free_port(), taken_port)
    assert started.returncode == 1
    assert f"port {taken_port} is in use" in started.stderr
    assert not (tmp_path / "triton.pid").exists()
