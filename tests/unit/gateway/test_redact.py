"""RedactKeys: sluice keys, upstream keys and JWTs are blanked in log lines and tracebacks; ordinary lines
pass as they are (the sluice-key cases are in test_keys.py)."""

from __future__ import annotations

import io
import logging

import pytest

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


def test_a_jwt_in_a_logged_exception_is_blanked_too() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactKeys())
    log = logging.getLogger("test.redact.jwt")
    log.addHandler(handler)
    try:
        raise ValueError(f"could not verify {JWT} with key {OPENAI}")
    except ValueError:
        log.exception("authentication failed")
    finally:
        log.removeHandler(handler)
    assert JWT not in out.getvalue() and OPENAI not in out.getvalue() and "[redacted JWT]" in out.getvalue()


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
