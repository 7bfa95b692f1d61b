"""MiniLM sentence embeddings (all-MiniLM-L6-v2, 384 dims) from the int8 ONNX model that
`minilm_onnx.py` converts once into the model cache. Mean pooling over the attention mask, then L2
normalisation, as sentence-transformers does.

Texts are embedded one at a time. The model quantises its activations on the fly with one scale per
tensor, so in a padded batch each text's embedding would depend on the others in it (the injection
score of one prompt moved by up to 0.18 between batch 1 and a batch of 300). One at a time, a
text's verdict is the same whatever arrives with it, and training sees exactly what serving sees;
on CPU, batching bought little anyway."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from pipeline.guard.errors import GuardModelMissing

DIMS = 384
MAX_TOKENS = 256  # the model's max_seq_length


def package_dir(name: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise GuardModelMissing(f"package {name!r} is not installed (see requirements.lock.txt)")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def load_embedder(model_cache: Path, threads: int = 1) -> MiniLmEmbedder:
    """The embedder from the model cache, converting it first if this machine has not yet (seconds,
    offline; `make setup` does it ahead). Loaded once per process: the guard and the cache share it."""
    from pipeline.guard.minilm_onnx import convert_minilm  # here: minilm_onnx imports this module

    return MiniLmEmbedder(convert_minilm(model_cache), threads)


@functools.cache
def load_tuned_embedder(model_cache: Path, threads: int = 1) -> MiniLmEmbedder:
    """The injection guard's fine-tuned encoder (`finetune.py`), built from the shipped adapters the
    first time (seconds, offline; `make setup` does it ahead). Loaded once per process."""
    from pipeline.guard.finetune import build  # here: finetune imports this module

    return MiniLmEmbedder(build(model_cache), threads)


class MiniLmEmbedder:
    def __init__(self, model_dir: Path, threads: int = 1) -> None:
        self.model_dir = model_dir
        model, tokenizer = model_dir / "model.onnx", model_dir / "tokenizer.json"
        for path in (model, tokenizer):
            if not path.is_file():
                raise GuardModelMissing(f"{path} is missing: run `python -m pipeline.guard.minilm_onnx {model_dir.parent}`")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self._tokenizer = Tokenizer.from_file(str(tokenizer))
        self._tokenizer.enable_truncation(MAX_TOKENS)
        self._tokenizer.enable_padding()

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(input ids, attention mask), int64 [len(texts), longest] (padded: for checks only)."""
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        return ids, np.array([e.attention_mask for e in encodings], dtype=np.int64)

    def reads_whole(self, text: str) -> bool:
        """Whether the model reads all of `text`: it keeps only the first MAX_TOKENS tokens (with its two
        markers), and a text cut there says nothing of its end to the embedding."""
        return len(self._tokenizer.encode(text).ids) < MAX_TOKENS

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), 384) float32, each row of unit length."""
        if not texts:
            return np.zeros((0, DIMS), dtype=np.float32)
        return np.concatenate([self._embed_one(text) for text in texts])

    def _embed_one(self, text: str) -> np.ndarray:
        ids, mask = self.tokenize([text])
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        return self.pool(self._session.run(None, feeds)[0], mask)

    @staticmethod
    def pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
