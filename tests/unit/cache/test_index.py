"""The semantic index passes the similarity it found to the trap check (vectors made by hand, no embedder)."""

from __future__ import annotations

import math
import time

import msgspec
import numpy as np

from pipeline.cache.index import SemanticIndex, from_vector
from pipeline.cache.traps import SUBSTITUTION_SIMILARITY, salient
from pipeline.guard.embedder import DIMS
from topics.cache import Entry

STORED = "How do I switch my energy tariff?"
ASKED = "How do I change my energy tariff?"  # one word for one, not WordNet synonyms


def unit(cosine: float) -> np.ndarray:
    """A unit vector at this cosine to the first axis."""
    vector = np.zeros(DIMS, dtype=np.float32)
    vector[0], vector[1] = cosine, math.sqrt(1 - cosine**2)
    return vector


def index_with_entry() -> SemanticIndex:
    index = SemanticIndex()
    now = time.time()
    index.apply(Entry("k", "t", "m", "c", ("answer",), "stop", 1, 1, now, now + 60, from_vector(unit(1.0)),
                      msgspec.msgpack.encode(salient(STORED))))
    return index


def test_a_substitution_is_served_at_a_high_similarity_and_refused_below() -> None:
    index = index_with_entry()
    close = index.search("t", "m", "c", unit(0.995), salient(ASKED), threshold=0.8)
    assert close is not None and close.similarity >= SUBSTITUTION_SIMILARITY
    assert index.search("t", "m", "c", unit(0.9), salient(ASKED), threshold=0.8) is None
    assert index.search("t", "m", "c", unit(0.9), salient(STORED), threshold=0.8) is not None
