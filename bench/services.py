"""Kafka and Redis of a benchmark's own, started fresh from infra/services.sh and stopped after."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def own_services(name: str, kafka_port: int, redis_port: int) -> Iterator[dict[str, str]]:
    """Runs them under `.state/<name>` for the block; yields the environment that points sluice at them."""
    state = ROOT / ".state" / name
    subprocess.run(["rm", "-rf", str(state)], check=True)
    subprocess.run([ROOT / "infra" / "services.sh", "start", state, str(kafka_port), str(redis_port)], check=True)
    try:
        yield {"SLUICE_KAFKA_BOOTSTRAP": f"127.0.0.1:{kafka_port}", "SLUICE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    finally:
        subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=True)
