"""A batch input file, line by line: `{"custom_id", "method", "url", "body"}` per line, as OpenAI's.

`read_input` reads the file one line at a time and yields each line to run or refused (the worker holds
only the few it is reading or running, never the whole file: reader.py); `parse_input` collects them
into two lists. Each has its line number (1-based, counting blank lines, so it matches an editor; blank
lines are skipped). A line is refused, and reported in the job's error file, when it is not a JSON
object, has no string `custom_id`, repeats an earlier `custom_id`, names a method other than POST or a
`url` other than the batch's endpoint, or has a body the bridge would refuse
(`openai_format.parse_chat`/`parse_completion`: the same checks as an interactive request), or asks to
stream. Limits that depend on the deployment (models, `max_tokens` cap, prompt size) stay ingest's: such
a line runs and fails with ingest's answer.

Pure: the same file always gives the same result, so a worker that restarts a job parses it again
and finds the same lines and the same keys.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline.bridge.openai_format import BadRequest, Parsed, parse_chat, parse_completion

log = logging.getLogger(__name__)

MAX_CUSTOM_ID = 512
MAX_LINE_BYTES = 1_000_000  # a line's request travels as one Kafka record (1 MiB at most by default)
_PARSERS = {"/v1/chat/completions": parse_chat, "/v1/completions": parse_completion}


@dataclass(frozen=True)
class Line:
    """A line to run."""

    number: int
    custom_id: str
    parsed: Parsed

    @property
    def key(self) -> str:
        """Its outcome's key in the job's record: the custom_id, which is unique among lines to run."""
        return self.custom_id


@dataclass(frozen=True)
class Rejected:
    """A line refused before it ran."""

    number: int
    custom_id: str | None
    code: str  # invalid_json, invalid_custom_id, duplicate_custom_id, invalid_method, invalid_url, invalid_body
    message: str
    param: str | None = None

    @property
    def key(self) -> str:
        return f"#{self.number}"  # a refused line may repeat a custom_id: keyed by its line number


def read_input(raw_lines: Iterable[bytes], endpoint: str) -> Iterator[Line | Rejected]:
    """Each non-blank line, parsed, in file order. It remembers only the custom_ids seen (to refuse a repeat)."""
    first_seen: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        outcome = _parse_line(number, raw, endpoint, first_seen)
        if isinstance(outcome, Line):
            first_seen[outcome.custom_id] = number
        yield outcome


def parse_input(raw_lines: Iterable[bytes], endpoint: str) -> tuple[list[Line], list[Rejected]]:
    lines: list[Line] = []
    rejected: list[Rejected] = []
    for outcome in read_input(raw_lines, endpoint):
        if isinstance(outcome, Line):
            lines.append(outcome)
        else:
            rejected.append(outcome)
    return lines, rejected


def _parse_line(number: int, raw: bytes, endpoint: str, first_seen: dict[str, int]) -> Line | Rejected:
    if len(raw) > MAX_LINE_BYTES:
        message = f"the line is {len(raw)} bytes; a line may be at most {MAX_LINE_BYTES} (a request is one Kafka record)"
        return Rejected(number, None, "line_too_large", message)
    try:
        item: Any = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return Rejected(number, None, "invalid_json", "the line is not valid JSON")
    if not isinstance(item, dict):
        return Rejected(number, None, "invalid_json", "the line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        message = f"`custom_id` must be a non-empty string of at most {MAX_CUSTOM_ID} characters"
        return Rejected(number, None, "invalid_custom_id", message, "custom_id")
    if custom_id in first_seen:
        message = f"`custom_id` {custom_id!r} is used again (first on line {first_seen[custom_id]})"
        return Rejected(number, custom_id, "duplicate_custom_id", message, "custom_id")
    method = item.get("method", "POST")
    if method != "POST":
        return Rejected(number, custom_id, "invalid_method", "`method` must be POST", "method")
    url = item.get("url")
    if url != endpoint:
        shown = url if isinstance(url, str) and len(url) <= 64 else "?"
        message = f"`url` {shown!r} is not the batch's endpoint {endpoint!r}"
        return Rejected(number, custom_id, "invalid_url", message, "url")
    body = item.get("body")
    if not isinstance(body, dict):
        return Rejected(number, custom_id, "invalid_body", "`body` must be a JSON object", "body")
    try:
        parsed = _PARSERS[endpoint](body)
    except BadRequest as exc:
        return Rejected(number, custom_id, "invalid_body", exc.message, f"body.{exc.param}" if exc.param else "body")
    except Exception:  # a body the parser did not foresee: this line's error, never the job's
        log.exception("batch line %d: the body could not be read", number)
        return Rejected(number, custom_id, "invalid_body", "the body could not be read", "body")
    if parsed.stream:
        return Rejected(number, custom_id, "invalid_body", "`stream` is not supported in a batch", "body.stream")
    return Line(number, custom_id, parsed)


__all__ = ["MAX_CUSTOM_ID", "MAX_LINE_BYTES", "Line", "Rejected", "parse_input", "read_input"]
