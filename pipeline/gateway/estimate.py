"""The prompt's tokens estimated without a tokenizer: what the gateway reserves at admission, and what a
generation stage bills when its backend reports no usage (the same rule in both places)."""

from __future__ import annotations

import math

from topics.requests import Request

NON_ASCII_BYTES_PER_TOKEN = 2  # UTF-8 bytes a token for text that is not ASCII
MESSAGE_TOKENS = 4  # a chat message's role markers (ChatML uses 5 with its newlines, OpenAI 3)


def prompt_estimate(request: Request, chars_per_token: int) -> int:
    """The prompt's tokens, estimated without a tokenizer (an upper-ish guess: `finish` corrects it):
    ASCII at `chars_per_token` bytes a token, every other byte at half a token (at most `chars_per_token`
    bytes a token), and MESSAGE_TOKENS for each chat message's role markers. Bytes / 4 alone reserved
    too little for text that is not ASCII; SmolLM2's tokenizer used, per bytes / 4: CJK 2.4x, Korean 3.5x,
    Cyrillic 2.1x, emoji 2.9x, combining marks 4.0x; per this rule: CJK 1.2x, Korean 1.9x, Cyrillic 1.1x,
    emoji 1.5x, combining marks 2.1x, English 0.9x, code 1.6x (both rules). Larger vocabularies use fewer
    tokens for text that is not ASCII (about one a CJK character: this rule reserves 1.5)."""
    texts = [m.content for m in request.messages] + [request.prompt or ""]
    ascii_bytes = sum(len(t.encode("ascii", "ignore")) for t in texts)  # C loops: a prompt may be 1 MiB
    other_bytes = sum(len(t.encode()) for t in texts) - ascii_bytes
    tokens = ascii_bytes / chars_per_token + other_bytes / min(chars_per_token, NON_ASCII_BYTES_PER_TOKEN)
    return math.ceil(tokens) + MESSAGE_TOKENS * len(request.messages)
