"""A logging filter that blanks anything shaped like a credential, as a second line of defence: sluice's
own log lines never carry one, and the libraries that would (aiokafka, whose DEBUG records include
message payloads, keys and prompts; httpx, which logs each request's URL) are pinned at WARNING by
`serve.configure_logging`. What it blanks, in one pattern:

    sk-sluice-<id>            a sluice API key          -> sk-sluice-[redacted]
    sk-<20 or more>           an upstream key (OpenAI's sk-..., sk-proj-..., Anthropic's sk-ant-...)
                                                        -> sk-[redacted]
    eyJ<...>.eyJ<...>.<...>   a JWT (a JSON header and payload, base64url)  -> [redacted JWT]

The last two start at a word boundary (`task-...`, `heyJude` are not keys), and an upstream key needs
20 characters (`sk-learn` is a library)."""

from __future__ import annotations

import logging
import re

KEY_PATTERN = re.compile(
    r"(?P<sluice>sk-sluice-[A-Za-z0-9_-]{4,})"
    r"|(?P<upstream>\bsk-[A-Za-z0-9_-]{20,})"
    r"|(?P<jwt>\beyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*)"
)
_BLANKS = {"sluice": "sk-sluice-[redacted]", "upstream": "sk-[redacted]", "jwt": "[redacted JWT]"}


def redact(text: str) -> str:
    """`text` with every credential KEY_PATTERN finds blanked."""
    if "sk-" not in text and "eyJ" not in text:  # most lines: no regex run
        return text
    return KEY_PATTERN.sub(lambda match: _BLANKS[match.lastgroup or ""], text)


class RedactKeys(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (redacted := redact(message)) != message:
            record.msg = redacted
            record.args = ()
        if record.exc_info and not record.exc_text:  # the traceback and the exception's own message too:
            text = _FORMATTER.formatException(record.exc_info)  # formatted here, once; the handler reuses it
            record.exc_text = redact(text)
        return True


_FORMATTER = logging.Formatter()
