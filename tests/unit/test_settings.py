"""Strict settings: unknown keys and wrong shapes are refused with the file, the key and what is allowed;
`sluice config check` prints the effective settings with secrets masked; allowed_hosts takes host and
host:port."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pipeline import cli
from pipeline.bridge.edges import AllowedHosts
from pipeline.gateway.hosts import allowed, parse_entry
from pipeline.settings import DEFAULT_CONFIG, MAX_PROMPT_BYTES, SettingsError, load


def load_text(tmp_path: Path, text: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return load(path, env or {})


def test_the_shipped_file_is_valid_and_its_replies_are_read() -> None:
    settings = load(DEFAULT_CONFIG, {})
    assert settings.replies == ("bridge", "sdk")
    assert "replies" not in DEFAULT_CONFIG.read_text().split("[bridge]")[1].split("\n[")[0]


def test_a_top_level_replies_list_takes_effect(tmp_path: Path) -> None:
    assert load_text(tmp_path, 'replies = ["bridge", "batch"]\n').replies == ("bridge", "batch")


@pytest.mark.parametrize(("text", "expected"), [
    ('[bridge]\nreplies = ["bridge"]\n', "`bridge.replies` is not a key of [bridge] (allowed: host, port, reply_name, "),
    ("typo = 1\n", "`typo` is not a key of the top level (allowed: kafka, redis,"),
    ("[gateway.tenants.acme]\nrpmm = 3\n", "`gateway.tenants.acme.rpmm` is not a key of [gateway.tenants.acme] (allowed: rpm, tpm,"),
    ('[[backends]]\nname = "a"\nmodel = "m"\npool = "p"\nbase = "x"\n', "`backends[0].base` is not a key of [backends[0]]"),
    ("[guard.tenants.acme]\ninjection_thresold = 0.3\n", "`guard.tenants.acme.injection_thresold` is not a key"),
    ("[cache.models.m]\nttl = 3\n", "`cache.models.m.ttl` is not a key of [cache.models.m] (allowed: ttl_s, threshold)"),
    ('[kafka]\npartitions = "4"\n', "`kafka.partitions`: expected `int`, got `str`"),
    ('[state]\nstore = "disk"\n', "`state.store`: invalid enum value 'disk' (allowed: one of 'redis', 'memory')"),
    ('[run]\nbridges = "all"\n', "`run.bridges`: invalid enum value 'all' (allowed: one of 'every', 'first')"),
    ('[guard.pii]\nEMAIL = "zap"\n', "(allowed: one of 'allow', 'redact', 'block')"),
    ("bridge = 3\n", "`bridge`: expected `object`, got `int`"),
])
def test_unknown_keys_and_wrong_shapes_name_the_file_the_key_and_what_is_allowed(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_text(tmp_path, text)
    assert str(caught.value).startswith(f"{tmp_path / 'sluice.toml'}: ")
    assert expected in str(caught.value)


@pytest.mark.parametrize("entry", ["example.com", "example.com:8443", "*.example.com", "127.0.0.1", "127.0.0.1:8092",
                                   "[::1]", "[::1]:8080", "localhost", "*"])
def test_allowed_hosts_accepts_host_and_host_port(tmp_path: Path, entry: str) -> None:
    assert load_text(tmp_path, f'[gateway]\nallowed_hosts = ["{entry}"]\n').gateway.allowed_hosts == (entry,)


@pytest.mark.parametrize("entry", ["127.0.0.1:", "example.com:http", "example.com:70000", "http://example.com", "::1",
                                   "[::1", "exa mple.com", ""])
def test_allowed_hosts_refuses_what_is_not_a_host(tmp_path: Path, entry: str) -> None:
    with pytest.raises(SettingsError, match="gateway.allowed_hosts"):
        load_text(tmp_path, f'[gateway]\nallowed_hosts = ["{entry}"]\n')


def test_host_matching_with_and_without_ports() -> None:
    entries = tuple(parse_entry(e) for e in ("127.0.0.1:8092", "example.com", "*.corp.example", "[::1]:9"))
    assert allowed("127.0.0.1:8092", entries)
    assert not allowed("127.0.0.1:8093", entries) and not allowed("127.0.0.1", entries)
    assert allowed("EXAMPLE.com", entries) and allowed("example.com:1234", entries)
    assert allowed("api.corp.example", entries) and not allowed("corp.example.evil", entries)
    assert allowed("[::1]:9", entries) and not allowed("[::1]:10", entries)
    assert not allowed("", entries) and not allowed("[::1", entries)


def test_the_bridge_answers_an_allowed_host_with_a_port_and_refuses_others() -> None:
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    client = TestClient(AllowedHosts(app, hosts=("127.0.0.1:8092",)))
    assert client.get("/", headers={"host": "127.0.0.1:8092"}).text == "ok"
    refused = client.get("/", headers={"host": "127.0.0.1:8093"})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "invalid Host header"


def test_config_check_prints_the_effective_settings_with_secrets_masked(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SLUICE_CONFIG", str(DEFAULT_CONFIG))
    monkeypatch.setenv("SLUICE_KAFKA_USER", "admin")
    monkeypatch.setenv("SLUICE_KAFKA_PASSWORD", "kafka-secret-123")
    monkeypatch.setenv("SLUICE_GATEWAY_SECRET", "gateway-secret-456")
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://sluice:redis-secret-789@127.0.0.1:16379/0")
    assert cli.main(["config", "check"]) == 0
    out = capsys.readouterr().out
    for secret in ("kafka-secret-123", "gateway-secret-456", "redis-secret-789"):
        assert secret not in out
    shown = json.loads(out)
    assert shown["gateway"]["kafka"] == {"protocol": "SASL_PLAINTEXT", "mechanism": "SCRAM-SHA-256", "username": "admin", "password": "***"}
    assert shown["gateway"]["client_info_secret"] == "***"
    assert shown["redis"]["url"] == "redis://sluice:***@127.0.0.1:16379/0"
    assert shown["replies"] == ["bridge", "sdk"]


def test_config_check_reports_an_invalid_file_and_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.toml").write_text("[bridge]\nprot = 1\n")
    monkeypatch.setenv("SLUICE_CONFIG", str(tmp_path / "bad.toml"))
    assert cli.main(["config", "check"]) == 2
    assert "`bridge.prot` is not a key of [bridge]" in capsys.readouterr().err


@pytest.mark.parametrize(("entry", "expected"), [
    ('kind = "instant"\nspeculative = "ngram"\n', "speculative needs kind local"),
    ('speculative = "ngram"\nnum_draft_tokens = 0\n', "num_draft_tokens 1..16"),
    ('speculative = "ngram"\nnum_draft_tokens = 17\n', "num_draft_tokens 1..16"),
    ('speculative = "medusa"\n', "invalid enum value 'medusa' (allowed: one of 'off', 'ngram')"),
    ('speculative = "ngram"\ndraft_tokens = 4\n', "`backends[0].draft_tokens` is not a key of [backends[0]]"),
])
def test_speculative_decoding_settings_are_checked(tmp_path: Path, entry: str, expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_text(tmp_path, f'[[backends]]\nname = "a"\nmodel = "m"\npool = "p"\n{entry}')
    assert expected in str(caught.value)


def test_a_prompt_limit_past_what_one_kafka_record_carries_is_refused(tmp_path: Path) -> None:
    assert load_text(tmp_path, f"[limits]\nmax_prompt_bytes = {MAX_PROMPT_BYTES}\n").limits.max_prompt_bytes == MAX_PROMPT_BYTES
    with pytest.raises(SettingsError, match="limits.max_prompt_bytes may be at most 524288"):
        load_text(tmp_path, f"[limits]\nmax_prompt_bytes = {MAX_PROMPT_BYTES + 1}\n")


def test_engine_dtype_is_float32_by_default_read_when_set_and_local_only(tmp_path: Path) -> None:
    assert all(b.dtype == "float32" for b in load(DEFAULT_CONFIG, {}).backends)
    [backend] = load_text(tmp_path, '[[backends]]\nname = "a"\nmodel = "m"\npool = "p"\ndtype = "bfloat16"\n').backends
    assert backend.dtype == "bfloat16"
    for entry, expected in (('kind = "instant"\ndtype = "bfloat16"\n', "dtype is a local backend's setting"),
                            ('dtype = "float16"\n', "invalid enum value 'float16'")):
        with pytest.raises(SettingsError) as caught:
            load_text(tmp_path, f'[[backends]]\nname = "a"\nmodel = "m"\npool = "p"\n{entry}')
        assert expected in str(caught.value)


def test_interrupt_batch_steps_is_read_checked_and_local_only(tmp_path: Path) -> None:
    assert all(b.interrupt_batch_steps == 1.0 for b in load(DEFAULT_CONFIG, {}).backends)
    [backend] = load_text(tmp_path, '[[backends]]\nname = "a"\nmodel = "m"\npool = "p"\ninterrupt_batch_steps = 0.5\n').backends
    assert backend.interrupt_batch_steps == 0.5
    for entry in ('interrupt_batch_steps = 1.5\n', 'interrupt_batch_steps = -1\n', 'kind = "instant"\ninterrupt_batch_steps = 0\n'):
        with pytest.raises(SettingsError) as caught:
            load_text(tmp_path, f'[[backends]]\nname = "a"\nmodel = "m"\npool = "p"\n{entry}')
        assert "interrupt_batch_steps is a local backend's setting, 0 to 1" in str(caught.value)


def test_speculative_decoding_is_off_by_default_and_read_when_set(tmp_path: Path) -> None:
    assert all(b.speculative == "off" for b in load(DEFAULT_CONFIG, {}).backends)
    entry = '[[backends]]\nname = "a"\nmodel = "m"\npool = "p"\nspeculative = "ngram"\nnum_draft_tokens = 6\n'
    [backend] = load_text(tmp_path, entry).backends
    assert (backend.speculative, backend.num_draft_tokens) == ("ngram", 6)


def test_each_backend_needs_a_pool_of_its_own(tmp_path: Path) -> None:
    two = '[[backends]]\nname = "gpu-a"\nmodel = "m"\npool = "gpu"\n[[backends]]\nname = "gpu-b"\nmodel = "m"\npool = "gpu"\n'
    with pytest.raises(SettingsError, match="pool 'gpu' has backends \\['gpu-a', 'gpu-b'\\]"):
        load_text(tmp_path, two)
    apart = two.replace('pool = "gpu"\n[[', 'pool = "gpu-a"\n[[').replace('pool = "gpu"\n', 'pool = "gpu-b"\n')
    assert [b.pool for b in load_text(tmp_path, apart).backends] == ["gpu-a", "gpu-b"]
