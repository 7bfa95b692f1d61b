"""RedactKeys: sluice keys, upstream keys and JWTs are blanked in log lines and tracebacks; ordinary lines
pass as they are."""

from __future__ import annotations

import io
import logging

import pytest

from pipeline.gateway.keys import new_key
from pipeline.gateway.redact import RedactKeys

JWT = ("eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJhY21lIiwidGVuYW50IjoiYWNtZSJ9."
       "c2lnbmF0dXJlLXRoYXQtaXMtbm90LXJlYWw")
OPENAI = "sk-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0U1v2W3x4"
PROJECT = "sk-proj-" + "Ab12_Cd34-Ef56Gh78Ij90Kl12Mn34Op56Qr78St90"


@pytest.mark.parametrize(("line", "secret", "blank"), [
    (f"upstream refused: Incorrect API key provided: {OPENAI}.", OPENAI, "sk-[redacted]"),
    (f"headers={{'authorization': 'Bearer {PROJECT}'}}", PROJECT, "sk-[redacted]"),
    (f"jwt refused: Bearer {JWT}", JWT, "[redacted JWT]"),
    (f"token={JWT}&next=1", JWT, "[redacted JWT]"),
])
def test_upstream_keys_and_jwts_are_blanked(line: str, secret: str, blank: str) -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%s", (line,), None)
    assert RedactKeys().filter(record)
    assert secret not in record.getMessage() and blank in record.getMessage()


def test_the_log_filter_blanks_anything_shaped_like_a_sluice_key() -> None:
    key = new_key()
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "sending %s to %s", (f'{{"api_key": "{key}"}}', "t"), None)
    assert RedactKeys().filter(record) and key not in record.getMessage() and "sk-sluice-[redacted]" in record.getMessage()


@pytest.mark.parametrize(("error", "secrets", "blank"), [
    ("upstream said: bad key sk-sluice-ABCDEFGHIJKLMNOP", ("ABCDEFGHIJKLMNOP",), "sk-sluice-[redacted]"),
    (f"could not verify {JWT} with key {OPENAI}", (JWT, OPENAI), "[redacted JWT]"),
])
def test_a_credential_in_a_logged_exception_is_blanked_too(error: str, secrets: tuple[str, ...], blank: str) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactKeys())
    log = logging.getLogger("test.redact.exception")
    log.addHandler(handler)
    try:
        raise ValueError(error)
    except ValueError:
        log.exception("a stage failed")
    finally:
        log.removeHandler(handler)
    assert blank in out.getvalue() and not any(secret in out.getvalue() for secret in secrets)


@pytest.mark.parametrize("line", [
    "running stages: ingest, guard, route, generate, emit",
    "task-0123456789abcdefghijklmnop finished; disk-usage-above-threshold-on-node-7",
    "imported sk-learn and ask-questions-about-the-weather-today",
    "request acme/3f2b9c4e-8d1a-4e6b-9f0a-1c2d3e4f5a6b took 12.5 ms",
    "heyJude.eyJust.words and eyJ without dots",
    "digest sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
])
def test_ordinary_lines_pass_unchanged(line: str) -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%s", (line,), None)
    assert RedactKeys().filter(record) and record.getMessage() == line
