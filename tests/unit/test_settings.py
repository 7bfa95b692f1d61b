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
    assert shown["gateway"]["kafka"] == {"protocol": "SASL_PLAINTEXT", "mechanism": "SCRAM-SHA-256", "username": "admin", "password": "***",
                                         "cafile": ""}
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


BACKEND = '[[backends]]\nname = "a"\nmodel = "m"\npool = "p"\n'


def test_a_config_file_that_is_named_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "gone.toml"
    with pytest.raises(SettingsError, match=f"{missing}: cannot read the config file"):
        load(missing, {})
    with pytest.raises(SettingsError, match=f"{missing}: cannot read the config file"):
        load(env={"SLUICE_CONFIG": str(missing)})
    (tmp_path / "broken.toml").write_text("[kafka\n")
    with pytest.raises(SettingsError, match="broken.toml: not valid TOML"):
        load(tmp_path / "broken.toml", {})
    monkeypatch.setattr("pipeline.settings.DEFAULT_CONFIG", missing)  # only the repository's own file may be absent
    assert load(env={}).gateway.auth_required is False


@pytest.mark.parametrize("value", ["inf", "nan", "1e12", "-1", str(366 * 86400)])
def test_rotate_overlap_is_bounded_as_keys_rotate_bounds_it(tmp_path: Path, value: str) -> None:
    with pytest.raises(SettingsError, match="gateway.rotate_overlap_s must be 0 or more seconds, under 31622400"):
        load_text(tmp_path, f"[gateway]\nrotate_overlap_s = {value}\n")


def test_rotate_overlap_within_the_bound_loads(tmp_path: Path) -> None:
    for value in (0, 365 * 86400):
        assert load_text(tmp_path, f"[gateway]\nrotate_overlap_s = {value}\n").gateway.rotate_overlap_s == value


@pytest.mark.parametrize(("entry", "expected"), [
    ("max_ejection_s = 0\n", "routing.max_ejection_s (0) must be at least routing.ejection_s (30)"),
    ("ejection_s = 60\nmax_ejection_s = 59\n", "routing.max_ejection_s (59) must be at least routing.ejection_s (60)"),
    ("health_stale_s = 0\n", "routing.health_stale_s must be positive, got 0"),
    ("health_stale_s = -1\n", "routing.health_stale_s must be positive, got -1"),
])
def test_routing_times_that_would_disable_ejection_or_health_are_refused(tmp_path: Path, entry: str, expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_text(tmp_path, f"[routing]\n{entry}")
    assert expected in str(caught.value)


@pytest.mark.parametrize(("table", "expected"), [
    ('[guard.routes."smollm2-135m-instruc"]\ntopics = ["Baggage."]\n', "guard.routes: ['smollm2-135m-instruc'] are not configured models"),
    ('[cache.models."smollm2"]\nttl_s = 60\n', "cache.models: ['smollm2'] are not configured models"),
    ('[gateway.tenants.acme]\nmodels = ["smollm2"]\n', "gateway.tenants.acme.models: ['smollm2'] are not configured models"),
    ('[gateway.tenants.acme]\nreplies = ["brige"]\n', "gateway.tenants.acme.replies: ['brige'] are not in replies (bridge, sdk)"),
    ('[gateway.tenants.acme]\nbudget = 5.0\n[gateway.prices."smollm2"]\nprompt_per_1k = 0.1\n',
     "gateway.prices.'smollm2': no backend serves this model (smollm2-135m-instruct)"),
])
def test_model_and_reply_keyed_entries_must_name_configured_ones(tmp_path: Path, table: str, expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_text(tmp_path, table)
    assert expected in str(caught.value)
    right = table.replace('"smollm2-135m-instruc"', '"smollm2-135m-instruct"').replace('"smollm2"', '"smollm2-135m-instruct"')
    load_text(tmp_path, right.replace('"brige"', '"bridge"'))


@pytest.mark.parametrize(("table", "key"), [
    ("[cache]\nttl_s = 604801\n", "cache.ttl_s"),
    ('[cache.models."smollm2-135m-instruct"]\nttl_s = 1e12\n', "cache.models.smollm2-135m-instruct.ttl_s"),
])
def test_a_cache_ttl_past_the_entries_topics_retention_is_refused(tmp_path: Path, table: str, key: str) -> None:
    """Redis refused an expiry that large ("invalid expire time"), and that refusal reached the client as a
    second terminal event (docs/reliability.md, session 47); an entry would also outlive its record on
    llm.cache.entries (7 days), from which the semantic tier is rebuilt."""
    with pytest.raises(SettingsError) as caught:
        load_text(tmp_path, table)
    assert f"{key} must be positive and at most 604800 s" in str(caught.value)
    load_text(tmp_path, table.replace("604801", "604800").replace("1e12", "604800"))


def test_a_price_for_another_model_loads_while_no_tenant_has_a_budget(tmp_path: Path) -> None:
    """The chaos harness swaps in the instant model and keeps sluice.toml's price (tests/chaos/harness.py)."""
    settings = load_text(tmp_path, f'{BACKEND}[gateway.prices."smollm2-135m-instruct"]\nprompt_per_1k = 0.1\n')
    assert set(settings.gateway.prices) == {"smollm2-135m-instruct"}


def test_routing_rules_may_name_the_backends_of_every_pool(tmp_path: Path) -> None:
    two = ('[[backends]]\nname = "gpu-a"\nmodel = "m"\npool = "a"\n[[backends]]\nname = "gpu-b"\nmodel = "m"\npool = "b"\n'
           '[[routing.rules]]\nname = "r"\nbackends = ["gpu-a", "gpu-b"]\n')
    assert load_text(tmp_path, two).routing.rules[0].backends == ("gpu-a", "gpu-b")
    with pytest.raises(SettingsError, match="routing rule 'r' names unknown backends \\['gpu-c'\\]"):
        load_text(tmp_path, two.replace('"gpu-b"]', '"gpu-c"]'))


@pytest.mark.parametrize("entry", [
    'kind = "openai"\nbase_url = "http://127.0.0.1:1/v1"\ntimeout_s = 0\n',
    'kind = "triton"\nurl = "127.0.0.1:1"\ntriton_model = "x"\ntimeout_s = -5\n',
    'kind = "instant"\ntoken_delay_ms = -1\n',
    "max_batch = 0\n",
])
def test_backend_timeouts_delays_and_batches_that_fail_every_request_are_refused(tmp_path: Path, entry: str) -> None:
    with pytest.raises(SettingsError, match="backend 'a': timeout_s must be positive, token_delay_ms 0 or more and max_batch at least 1"):
        load_text(tmp_path, BACKEND + entry)


@pytest.mark.parametrize("text", ["[state]\nttl_s = 1\n", "[state]\nttl_s = 0\n", "[state]\nttl_s = -1\n",
                                  "[state]\nttl_s = 600\n[limits]\nmax_deadline_s = 601\n[batch]\nline_deadline_s = 600\n"])
def test_request_state_must_outlive_the_longest_deadline(tmp_path: Path, text: str) -> None:
    with pytest.raises(SettingsError, match="state.ttl_s .* must be positive and at least limits.max_deadline_s"):
        load_text(tmp_path, text)


def test_request_state_as_long_as_the_longest_deadline_loads(tmp_path: Path) -> None:
    settings = load_text(tmp_path, "[state]\nttl_s = 600\n[limits]\nmax_deadline_s = 600\n[batch]\nline_deadline_s = 600\n")
    assert settings.state.ttl_s == settings.limits.max_deadline_s == 600


@pytest.mark.parametrize(("text", "env", "expected"), [
    ("[bridge]\nport = 0\n", {}, "bridge.port (or SLUICE_BRIDGE_PORT) must be 1 to 65535, got 0"),
    ("[bridge]\nport = 70000\n", {}, "bridge.port (or SLUICE_BRIDGE_PORT) must be 1 to 65535, got 70000"),
    ("", {"SLUICE_BRIDGE_PORT": "-1"}, "bridge.port (or SLUICE_BRIDGE_PORT) must be 1 to 65535, got -1"),
    ("[runtime]\ntorch_threads = 0\n", {}, "runtime.torch_threads must be at least 1, got 0"),
    ("[limits]\nmax_messages = 0\n", {}, "limits.max_messages must be at least 1, got 0"),
    ("[limits]\nmax_messages = -3\n", {}, "limits.max_messages must be at least 1, got -3"),
])
def test_values_that_crash_at_start_or_refuse_every_request_are_refused_at_load(
        tmp_path: Path, text: str, env: dict[str, str], expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_text(tmp_path, text, env)
    assert expected in str(caught.value)


def test_config_check_prints_the_values_the_file_leaves_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "sparse.toml").write_text('[kafka]\npartitions = 3\n[redis]\nurl = "redis://u:pw-in-file@127.0.0.1:1/0"\n')
    monkeypatch.setenv("SLUICE_CONFIG", str(tmp_path / "sparse.toml"))
    monkeypatch.setenv("SLUICE_METRICS_TOKEN", "metrics-secret-1")
    assert cli.main(["config", "check"]) == 0
    out = capsys.readouterr().out
    assert "pw-in-file" not in out and "metrics-secret-1" not in out
    shown = json.loads(out)
    assert shown["kafka"] == {"bootstrap": "127.0.0.1:19092", "partitions": 3, "session_timeout_ms": 3000,
                              "heartbeat_interval_ms": 500, "linger_ms": 0, "lingering_ms": 20}
    assert shown["redis"] == {"url": "redis://u:***@127.0.0.1:1/0", "username": "", "password": ""}
    assert shown["bridge"]["metrics_token"] == "***" and shown["bridge"]["port"] == 8080


def test_config_check_masks_credentials_in_every_url_valued_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Only fields named `url` were masked: a backend's base_url, the OTLP endpoint and the JWKS URL were
    printed with their userinfo and query strings."""
    (tmp_path / "urls.toml").write_text(
        '[[backends]]\nname = "local"\nmodel = "smollm2-135m-instruct"\npool = "local"\n'
        '[[backends]]\nname = "up"\nmodel = "gpt-4o"\npool = "up"\nkind = "openai"\n'
        'base_url = "https://user:base-pw@api.example.com/v1?key=base-key"\n'
        '[observability]\notlp_endpoint = "https://collector.example.com/v1/traces?token=otlp-token"\n'
        '[gateway.jwt]\njwks_url = "https://jwks-token@idp.example.com/jwks#frag-secret"\n')
    monkeypatch.setenv("SLUICE_CONFIG", str(tmp_path / "urls.toml"))
    assert cli.main(["config", "check"]) == 0
    out = capsys.readouterr().out
    for secret in ("base-pw", "base-key", "otlp-token", "jwks-token", "frag-secret"):
        assert secret not in out
    shown = json.loads(out)
    assert shown["backends"][1]["base_url"] == "https://user:***@api.example.com/v1?***"
    assert shown["observability"]["otlp_endpoint"] == "https://collector.example.com/v1/traces?***"
    assert shown["gateway"]["jwt"]["jwks_url"] == "https://***@idp.example.com/jwks#***"
    assert shown["kafka"]["bootstrap"] == "127.0.0.1:19092" and shown["backends"][0]["model"] == "smollm2-135m-instruct"


def test_a_redis_password_in_its_url_is_not_in_the_settings_repr(tmp_path: Path) -> None:
    settings = load_text(tmp_path, '[redis]\nurl = "redis://u:repr-secret@127.0.0.1:1/0"\n')
    assert "repr-secret" not in repr(settings) and "redis://u:***@127.0.0.1:1/0" in repr(settings.redis)
    assert settings.redis.url == "redis://u:repr-secret@127.0.0.1:1/0"  # used as it is


@pytest.mark.parametrize(("toml", "expected"), [
    ("[gateway]\nwindow_s = nan\n", "window_s, chars_per_token and redis_timeout_s must be positive"),
    ("[gateway]\nkey_cache_s = inf\n", "gateway.key_cache_s must be 0 to 3600 seconds, got inf"),
    ("[gateway]\nkey_cache_s = nan\n", "gateway.key_cache_s must be 0 to 3600 seconds, got nan"),
    ("[cache]\nttl_s = nan\n", "cache.ttl_s must be positive and at most 604800 s (7 days: llm.cache.entries' retention), got "
                               "nan"),
    ("[cache]\nttl_s = inf\n", "cache.ttl_s must be positive and at most 604800 s"),
])
def test_not_a_number_and_infinity_are_refused_where_they_would_disable_a_bound(tmp_path: Path, toml: str, expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_text(tmp_path, toml)
    assert expected in str(caught.value)


def test_a_cost_ceiling_over_a_backend_without_a_price_is_refused(tmp_path: Path) -> None:
    """Its model read as free and passed any ceiling (docs/reliability.md, session 47)."""
    two = ('[[backends]]\nname = "gpu-a"\nmodel = "m"\npool = "a"\n[[backends]]\nname = "gpu-b"\nmodel = "n"\npool = "b"\n'
           '[gateway.prices.m]\nprompt_per_1k = 0.1\n'
           '[[routing.rules]]\nname = "cheap"\nbackends = ["gpu-a", "gpu-b"]\nmax_cost_per_1k = 0.5\n')
    with pytest.raises(SettingsError, match="routing rule 'cheap' has a cost ceiling but backend 'gpu-b'"):
        load_text(tmp_path, two)
    assert load_text(tmp_path, two.replace('"gpu-a", "gpu-b"]', '"gpu-a"]')).routing.rules[0].backends == ("gpu-a",)


def test_a_rule_whose_backends_serve_none_of_its_models_is_refused(tmp_path: Path) -> None:
    """A rule sends a request only to its backends of the request's model (session 47): this one never would."""
    two = ('[[backends]]\nname = "gpu-a"\nmodel = "m"\npool = "a"\n[[backends]]\nname = "gpu-b"\nmodel = "n"\npool = "b"\n'
           '[[routing.rules]]\nname = "r"\nmodels = ["n"]\nbackends = ["gpu-a"]\n')
    with pytest.raises(SettingsError, match="routing rule 'r' can match no request: none of its backends serves"):
        load_text(tmp_path, two)
    assert load_text(tmp_path, two.replace('["gpu-a"]', '["gpu-a", "gpu-b"]')).routing.rules[0].models == ("n",)


@pytest.mark.parametrize("tenant", ["", "a b", "a/b", "x\ny", "x" * 129])
def test_the_anonymous_tenant_is_a_tenant_name(tmp_path: Path, tenant: str) -> None:
    """It is the tenant in every keyless request's id (`<tenant>/<id>`): one the wire's id rule refuses
    (topics.hops.REQUEST_ID) made every such request unreadable after ingest."""
    with pytest.raises(SettingsError, match="gateway.anonymous_tenant must be printable"):
        load_text(tmp_path, f"[gateway]\nanonymous_tenant = {json.dumps(tenant)}\n")
    loaded = load_text(tmp_path, '[gateway]\nanonymous_tenant = "租户-1.é"\n')
    assert loaded.gateway.anonymous_tenant == "租户-1.é"
