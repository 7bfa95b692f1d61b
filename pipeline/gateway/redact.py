"""A logging filter that blanks anything shaped like a sluice API key, as a second line of defence:
sluice's own log lines never carry one, and aiokafka (whose DEBUG records include message payloads,
keys and prompts) is pinned at WARNING by `serve.configure_logging`."""

from __future__ import annotations

import logging
import re

KEY_PATTERN = re.compile(r"sk-sluice-[A-Za-z0-9_-]{4,}")


class RedactKeys(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "sk-sluice-" in message:
            record.msg = KEY_PATTERN.sub("sk-sluice-[redacted]", message)
            record.args = ()
        if record.exc_info and not record.exc_text:  # the traceback and the exception's own message too:
            text = _FORMATTER.formatException(record.exc_info)  # formatted here, once; the handler reuses it
            record.exc_text = KEY_PATTERN.sub("sk-sluice-[redacted]", text)
        return True


_FORMATTER = logging.Formatter()
