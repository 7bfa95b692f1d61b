"""postprocessing: the TensorRT-LLM engine's token ids back to text (triton_models/ensemble).

TOKENS_BATCH is [batch, beams, tokens] and SEQUENCE_LENGTH [batch, beams]; with exclude_input_in_output
they hold only generated tokens (in streaming mode, the tokens new in this response). OUTPUT is each
beam's first SEQUENCE_LENGTH tokens as UTF-8 bytes: the concatenation of each token's own bytes, special
tokens skipped.

Why bytes and not `tokenizer.decode` of the response's tokens: in streaming mode each response is a
request of its own here, with no state from the earlier ones, and a character may span tokens (😀 is
three tokens of SmolLM2's byte-level BPE): decoded alone, each one came out as U+FFFD. A token's bytes
do not depend on its neighbours, so the responses' OUTPUTs, concatenated, are the completion's exact
UTF-8; a response may end inside a character, which the next one completes. A client decodes the stream
incrementally (pipeline/backends/triton.py does); the whole OUTPUT of a non-streaming request is valid
UTF-8. The table of bytes is built at load from the vocabulary (byte-level BPE: each token's characters
mapped back to bytes; SentencePiece: "▁" as a space, `<0xNN>` byte-fallback tokens as that byte) and
checked then on a probe text, which its tokens' bytes must give back; a tokenizer it does not fit
(WordPiece, one that cannot write the text back) fails the load rather than garble the stream
(NVIDIA's `tensorrt_llm_bls` with `accumulate_tokens` serves those). Unlike `decode`, no clean-up of spaces before punctuation is
applied (as sluice's own engine), and a SentencePiece completion keeps the space before its first word.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

# The load-time check's text: ASCII, runs of spaces, a tab, a newline, and characters of two, three and
# four UTF-8 bytes (the last ones split across tokens by every byte-level vocabulary).
PROBE = "Hello, world!  Two  spaces\tand a tab.\nnaïve café, 日本語, ✓ and 😀🙂 done."
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_METASPACE = "\u2581"  # SentencePiece's word boundary, a space in the text


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        tokenizer_dir = config["parameters"]["tokenizer_dir"]["string_value"]
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        self._bytes = token_bytes(tokenizer)
        problem = mismatch(tokenizer, self._bytes)
        if problem is not None:
            raise pb_utils.TritonModelException(
                f"postprocessing cannot stream {tokenizer_dir}'s tokens as bytes: {problem}"
            )

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        if tokens.ndim == 2:  # [batch, tokens]: one beam
            tokens = tokens[:, None, :]
        lengths = lengths.reshape(tokens.shape[0], tokens.shape[1])
        texts = [
            [self._join(tokens[b, k, : min(int(lengths[b, k]), tokens.shape[2])]) for k in range(tokens.shape[1])]
            for b in range(tokens.shape[0])
        ]
        output = np.array(texts, dtype=np.object_)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)])

    def _join(self, ids: np.ndarray) -> bytes:
        table = self._bytes
        return b"".join(table[i] for i in ids.tolist() if 0 <= i < len(table))  # an id past the vocabulary: nothing


def token_bytes(tokenizer: Any) -> list[bytes]:
    """Each token id's bytes in the text (b"" for a special token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # None: a slow tokenizer, its decoder unknown
    decoder = (json.loads(backend.to_str()).get("decoder") if backend is not None else None) or {}
    types = _types(decoder)
    alphabet = _byte_level_alphabet() if "ByteLevel" in types else {}
    byte_fallback = "ByteFallback" in types or not decoder
    added = tokenizer.added_tokens_decoder
    special = set(tokenizer.all_special_ids)
    table = []
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token is None or i in special or (i in added and added[i].special):
            table.append(b"")
        elif i in added:  # an added token's text is its content as written
            table.append(added[i].content.encode())
        elif byte_fallback and (byte := _BYTE_TOKEN.fullmatch(token)) is not None:
            table.append(bytes([int(byte.group(1), 16)]))
        elif alphabet and all(c in alphabet for c in token):
            table.append(bytes(alphabet[c] for c in token))
        else:
            table.append(token.replace(_METASPACE, " ").encode())
    return table


def mismatch(tokenizer: Any, table: list[bytes]) -> str | None:
    """None when PROBE's tokens, joined from the table, give PROBE back, else what they give. A leading
    space more is allowed: a SentencePiece tokenizer marks a text's first word with one (its decode strips
    it; inside a completion it is part of the text)."""
    ids = [int(t) for t in tokenizer(PROBE, add_special_tokens=False)["input_ids"]]
    got = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
    return None if got in (PROBE, " " + PROBE) else f"{PROBE!r} comes back as {got!r}"


def _types(decoder: dict[str, Any]) -> set[str]:
    """The types of a decoder and of those in it (a Sequence)."""
    return {decoder.get("type", ""), *(t for inner in decoder.get("decoders", []) for t in _types(inner))}


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters and the byte each stands for (GPT-2's `bytes_to_unicode`, reversed):
    printable Latin-1 bytes stand for themselves, the others for U+0100 onwards, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}
