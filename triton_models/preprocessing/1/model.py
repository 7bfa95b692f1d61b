"""preprocessing: text in, token ids out, for the TensorRT-LLM engine (triton_models/ensemble).

QUERY is tokenised as it is; when MESSAGES (sluice's extension: chat messages as JSON) is present, the
tokenizer's chat template is applied to it instead, with the generation prompt. Stop and bad words become
TensorRT-LLM's word lists: per request a [2, n] array of the words' concatenated token ids and their end
offsets (padded with -1). END_ID and PAD_ID default to the tokenizer's. A malformed request gets an error
response (`sluice.InvalidRequest: ...`, which pipeline/backends/triton.py maps back); the others in the
batch are served.
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
        self._end_id = int(self._tokenizer.eos_token_id)
        pad = self._tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else self._end_id

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        try:
            rows = [self._prompt_ids(query, messages) for query, messages in self._prompts(request)]
        except (ValueError, KeyError, TypeError) as exc:
            error = pb_utils.TritonError(f"sluice.InvalidRequest: {exc}", pb_utils.TritonError.INVALID_ARG)
            return pb_utils.InferenceResponse(error=error)
        batch = len(rows)
        width = max(len(ids) for ids in rows)
        input_ids = np.full((batch, width), self._pad_id, dtype=np.int32)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = ids
        lengths = np.array([[len(ids)] for ids in rows], dtype=np.int32)
        output_len = _input(request, "REQUEST_OUTPUT_LEN").astype(np.int32).reshape(batch, 1)
        end_id = _input(request, "END_ID")
        pad_id = _input(request, "PAD_ID")
        tensors = {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": lengths,
            "REQUEST_OUTPUT_LEN": output_len,
            "STOP_WORDS_IDS": self._word_lists(_input(request, "STOP_WORDS_DICT"), batch),
            "BAD_WORDS_IDS": self._word_lists(_input(request, "BAD_WORDS_DICT"), batch),
            "OUT_END_ID": (end_id if end_id is not None else np.full((batch, 1), self._end_id)).astype(np.int32),
            "OUT_PAD_ID": (pad_id if pad_id is not None else np.full((batch, 1), self._pad_id)).astype(np.int32),
        }
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])

    def _prompts(self, request: Any) -> list[tuple[str, str | None]]:
        queries = _input(request, "QUERY").reshape(-1)
        messages = _input(request, "MESSAGES")
        chats = messages.reshape(-1) if messages is not None else [None] * len(queries)
        return [(_text(q), _text(m) if m is not None and len(m) else None) for q, m in zip(queries, chats, strict=True)]

    def _prompt_ids(self, query: str, messages: str | None) -> list[int]:
        if messages:
            chat = [{"role": str(m["role"]), "content": str(m["content"])} for m in json.loads(messages)]
            ids = [int(t) for t in self._tokenizer.apply_chat_template(chat, add_generation_prompt=True)]
        else:
            ids = [int(t) for t in self._tokenizer(query, add_special_tokens=False)["input_ids"]]
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def _word_lists(self, words: np.ndarray | None, batch: int) -> np.ndarray:
        """TensorRT-LLM's [batch, 2, n] word lists (an empty list is [[0], [-1]])."""
        lists = []
        for row in range(batch):
            ids: list[int] = []
            ends: list[int] = []
            for word in words[row].reshape(-1) if words is not None else []:
                text = _text(word)
                if text:
                    ids += self._tokenizer(text, add_special_tokens=False)["input_ids"]
                    ends.append(len(ids))
            lists.append((ids or [0], ends or [-1]))
        width = max(max(len(ids), len(ends)) for ids, ends in lists)
        out = np.zeros((batch, 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for row, (ids, ends) in enumerate(lists):
            out[row, 0, : len(ids)] = ids
            out[row, 1, : len(ends)] = ends
        return out


def _input(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
