"""Redis in the secure profile (issue 14, item 2): ACL users with passwords from mode-600 files, none on a
command line; an unauthenticated client is refused; sluice's processes work as the `sluice` user, with
the password from the environment, and can reach only sluice's keys."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from pipeline import settings as settings_module
from pipeline.gateway.build import redis_client, redis_gateway
from pipeline.stages.ingest import IngestStage
from pipeline.state import RedisStateStore
from pipeline.strict import masked
from tests.ports import free_port
from tests.unit.fakes import run_handler
from tests.unit.helpers import node
from topics.requests import ChatMessage, Request, Sampling

ROOT = Path(__file__).resolve().parents[2]



@dataclass(frozen=True)
class SecureRedis:
    port: int
    state: Path

    def password(self, user: str) -> str:
        return (self.state / f"redis-{user}.password").read_text().strip()

    def env(self) -> dict[str, str]:
        """What infra/run.sh gives sluice's processes in the secure profile."""
        return {"SLUICE_REDIS_URL": f"redis://127.0.0.1:{self.port}/0", "SLUICE_REDIS_USER": "sluice",
                "SLUICE_REDIS_PASSWORD": self.password("sluice")}


@pytest.fixture(scope="module")
def secure_redis() -> Iterator[SecureRedis]:
    port = free_port()
    state = ROOT / ".state" / f"test-secure-redis-{port}"
    shutil.rmtree(state, ignore_errors=True)
    subprocess.run([ROOT / "infra" / "redis" / "start.sh", state, str(port), "--secure"], check=True)
    try:
        yield SecureRedis(port, state)
    finally:
        subprocess.run([ROOT / "infra" / "services.sh", "stop", state], check=True)
        shutil.rmtree(state, ignore_errors=True)


def test_the_passwords_are_private_files_and_never_arguments(secure_redis: SecureRedis) -> None:
    for name in ("redis-sluice.password", "redis-admin.password", "redis-users.acl"):
        assert stat.S_IMODE((secure_redis.state / name).stat().st_mode) == 0o600, name
    passwords = [secure_redis.password("sluice"), secure_redis.password("admin")]
    assert all(len(p) >= 32 for p in passwords)
    assert not any(p in (secure_redis.state / "redis-users.acl").read_text() for p in passwords)  # hashes only
    admin = Redis(port=secure_redis.port, username="admin", password=secure_redis.password("admin"), socket_timeout=2)
    assert admin.config_get("aclfile")["aclfile"] == str(secure_redis.state / "redis-users.acl")
    for proc in Path("/proc").iterdir():  # no process's arguments hold either password
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert not any(p in args for p in passwords), proc.name
    aof = [f for f in (secure_redis.state / "appendonlydir").iterdir()]
    assert aof and all(stat.S_IMODE(f.stat().st_mode) & 0o077 == 0 for f in aof)  # key records: private too


def test_an_unauthenticated_or_wrong_client_is_refused(secure_redis: SecureRedis) -> None:
    anonymous = Redis(port=secure_redis.port, socket_timeout=2)
    with pytest.raises(AuthenticationError):  # NOAUTH
        anonymous.get("sluice:keyids")
    with pytest.raises(AuthenticationError):
        Redis(port=secure_redis.port, username="sluice", password="not-the-password", socket_timeout=2).ping()
    with pytest.raises(AuthenticationError):
        Redis(port=secure_redis.port, username="default", password="", socket_timeout=2).ping()


def test_the_sluice_user_reaches_only_sluices_keys(secure_redis: SecureRedis) -> None:
    sluice = Redis(port=secure_redis.port, username="sluice", password=secure_redis.password("sluice"), socket_timeout=2)
    assert sluice.set("sluice:probe", "1") and sluice.get("sluice:probe") == b"1"
    for command in (("SET", "other", "1"), ("FLUSHALL",), ("CONFIG", "GET", "dir"), ("ACL", "LIST"), ("SHUTDOWN",)):
        with pytest.raises((NoPermissionError, ResponseError)):
            sluice.execute_command(*command)
    admin = Redis(port=secure_redis.port, username="admin", password=secure_redis.password("admin"), socket_timeout=2)
    assert admin.config_get("dir")["dir"] == str(secure_redis.state)  # the operator's user can


@pytest.mark.asyncio(loop_scope="session")
async def test_sluices_processes_work_with_the_password_from_the_environment(secure_redis: SecureRedis) -> None:
    env = {**os.environ, **secure_redis.env()}
    created = subprocess.run([sys.executable, "-m", "pipeline.cli", "keys", "create", "--tenant", "acme"], env=env,
                             capture_output=True, text=True, timeout=60, check=True)
    key = next(word for word in created.stdout.split() if word.startswith("sk-sluice-"))
    settings = settings_module.load(env=secure_redis.env())
    assert settings.redis.username == "sluice" and settings.redis.password == secure_redis.password("sluice")
    assert masked(settings)["redis"]["password"] == "***"  # what `sluice config check` prints
    ingest = IngestStage(settings, node("ingest").topics, redis_gateway(settings),
                         RedisStateStore(redis_client(settings), ttl_s=60.0))
    try:
        request = Request(id="sec-" + uuid.uuid4().hex[:12], reply_to="llm.responses.sdk", model=settings.models[0],
                          created_at=time.time(), messages=(ChatMessage(role="user", content="hello"),),
                          sampling=Sampling(max_tokens=4), api_key=key)
        [admitted] = await run_handler(ingest, request)  # key lookup, Lua limits, the state store's claim
        assert admitted.value.tenant == "acme"
    finally:
        await ingest.aclose()
    listed = subprocess.run([sys.executable, "-m", "pipeline.cli", "keys", "list"], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    assert "acme" in listed.stdout
    refused = subprocess.run([sys.executable, "-m", "pipeline.cli", "keys", "list"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "SLUICE_REDIS_URL": secure_redis.env()["SLUICE_REDIS_URL"]})
    assert refused.returncode != 0  # the same command without the password is refused
