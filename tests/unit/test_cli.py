"""The `sluice` command: an error the user can fix (the configuration, a broker that is not up, a stage
the profile lacks, an out-of-range argument) is one line and exit status 2, never a traceback; a bug keeps
its traceback. `sluice batch` reaches the configured bridge over https when it serves TLS."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline import assemble, cli
from pipeline import settings as settings_module
from pipeline.batch import cli as batch_cli
from pipeline.gateway.config import TlsSettings
from pipeline.settings import Settings
from tests.ports import free_port


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("sluice ")]
    return line


def test_an_invalid_configuration_is_one_line_for_every_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.toml").write_text("[limits]\nmax_messages = 0\n")
    monkeypatch.setenv("SLUICE_CONFIG", str(tmp_path / "bad.toml"))
    assert cli.main(["topics", "list"]) == 2
    assert one_line(capsys) == "sluice topics: invalid configuration: limits.max_messages must be at least 1, got 0"
    monkeypatch.setenv("SLUICE_CONFIG", str(tmp_path / "missing.toml"))
    assert cli.main(["keys", "list"]) == 2
    assert "missing.toml: cannot read the config file" in one_line(capsys)


def test_a_stage_the_profile_lacks_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # the worker's own selection, without starting its logging, metrics and stages
    monkeypatch.setattr("pipeline.process.run_worker", lambda *names: assemble.nodes_of(settings_module.load(), list(names)))
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    assert cli.main(["worker", "decoder"]) == 2
    assert one_line(capsys) == "sluice worker: not in this deployment's profile: decoder"


def test_ask_without_a_broker_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", f"127.0.0.1:{free_port()}")  # nothing listens there
    assert cli.main(["ask", "hello"]) == 2
    assert one_line(capsys).startswith("sluice ask: Kafka: KafkaConnectionError: Unable to bootstrap")


@pytest.mark.parametrize(("argv", "expected"), [
    (["ask", "hi", "--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
    (["ask", "hi", "--temperature", "3"], "argument --temperature: must be 0 to 2, got 3"),
    (["ask", "hi", "--temperature", "nan"], "argument --temperature: must be 0 to 2, got nan"),
    (["ask", "hi", "--max-tokens", "many"], "argument --max-tokens: not a number: 'many'"),
    (["run", "--processes", "-5"], "argument --processes: must be at least 0, got -5"),
])
def test_out_of_range_arguments_are_refused_before_anything_connects(
        argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def never(*args: object, **kwargs: object) -> Settings:
        raise AssertionError("settings loaded: the argument was not checked first")

    monkeypatch.setattr(settings_module, "load", never)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(settings: Settings, action: str) -> int:
        return {}["missing"]  # type: ignore[no-any-return]

    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    monkeypatch.setattr(cli, "_topics", broken)
    with pytest.raises(KeyError):
        cli.main(["topics", "list"])


@pytest.mark.asyncio
@pytest.mark.parametrize(("host", "tls", "expected"), [
    ("127.0.0.1", TlsSettings(), "http://127.0.0.1:8080/v1/"),
    ("127.0.0.1", TlsSettings(certfile="server.pem", keyfile="server.key"), "https://127.0.0.1:8080/v1/"),
    ("::", TlsSettings(), "http://[::]:8080/v1/"),
    ("::1", TlsSettings(certfile="server.pem", keyfile="server.key"), "https://[::1]:8080/v1/"),
])
async def test_batch_commands_reach_the_configured_bridge(host: str, tls: TlsSettings, expected: str) -> None:
    settings = Settings()
    settings = replace(settings, bridge=replace(settings.bridge, host=host), gateway=replace(settings.gateway, tls=tls))
    async with batch_cli._http(settings, argparse.Namespace(base_url=None, api_key=None)) as http:
        assert str(http.base_url) == expected
