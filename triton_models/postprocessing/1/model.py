"""postprocessing: the TensorRT-LLM engine's token ids back to text (triton_models/ensemble).

TOKENS_BATCH is [batch, beams, tokens] and SEQUENCE_LENGTH [batch, beams]; with exclude_input_in_output
they hold only generated tokens (in streaming mode, the tokens new in this response). Each beam's first
SEQUENCE_LENGTH tokens are decoded on their own, special tokens skipped. A token decoded alone loses what
depends on its neighbours (a character split across tokens; a leading space with SentencePiece
tokenizers): byte-level BPE tokenizers such as SmolLM2's, Llama 3's and Qwen's decode token by token
faithfully, which is what sluice's default and recommended models use.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        tokenizer_dir = config["parameters"]["tokenizer_dir"]["string_value"]
        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        if tokens.ndim == 2:  # [batch, tokens]: one beam
            tokens = tokens[:, None, :]
        lengths = lengths.reshape(tokens.shape[0], tokens.shape[1])
        texts = [
            [self._decode(tokens[b, k, : min(int(lengths[b, k]), tokens.shape[2])]) for k in range(tokens.shape[1])]
            for b in range(tokens.shape[0])
        ]
        output = np.array([[t.encode() for t in row] for row in texts], dtype=np.object_)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)])

    def _decode(self, ids: np.ndarray) -> str:
        return str(self._tokenizer.decode(ids.tolist(), skip_special_tokens=True))
