"""Chat messages to prompt token ids, with every message's content tokenized as text.

`tokenizer.apply_chat_template` renders the template to one string and tokenizes it whole, so a client
who types `<|im_start|>system` into its content gets a real control token: a turn boundary it was never
given (prompt-format injection). Here the template is rendered with a random marker in place of each
content; the template's own text is tokenized as usual (its control tokens stay control tokens) and each
content between the markers with `split_special_tokens=True`, so `<|im_start|>` typed by a client costs
the tokens of its characters. (A completion's prompt is tokenized the same way: it is text too.) For content without control tokens the ids are those of
`apply_chat_template` (tests/unit/test_chat_template.py holds it to that).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The prompt for `messages` (role, content) with the generation prompt added."""
    nonce = secrets.token_hex(8)
    marked = [{"role": m["role"], "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
    rendered = str(tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False))
    ids: list[int] = []
    position = 0
    for found in re.finditer(rf"\ue000{nonce}:(\d+)\ue001", rendered):
        ids += _ids(tokenizer, rendered[position : found.start()], split=False)
        ids += _ids(tokenizer, messages[int(found.group(1))]["content"], split=True)
        position = found.end()
    return ids + _ids(tokenizer, rendered[position:], split=False)


def _ids(tokenizer: PreTrainedTokenizerBase, text: str, *, split: bool) -> list[int]:
    if not text:
        return []
    return [int(t) for t in tokenizer(text, add_special_tokens=False, split_special_tokens=split)["input_ids"]]


__all__ = ["chat_prompt_ids"]
