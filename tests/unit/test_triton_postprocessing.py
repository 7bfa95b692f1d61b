"""triton_models/postprocessing/1/model.py (the TensorRT-LLM ensemble's detokenizer) without Triton: a
stand-in for `triton_python_backend_utils`, and streamed responses fed to it one request each, as the
ensemble does (the real server: tests/integration/test_triton.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "triton_models" / "postprocessing" / "1" / "model.py"
SMOLLM2 = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
EMOJI = "\N{GRINNING FACE}"


def _pb_utils() -> ModuleType:
    pb = ModuleType("triton_python_backend_utils")
    pb.TritonModelException = RuntimeError  # type: ignore[attr-defined]
    pb.Tensor = lambda name, array: (name, array)  # type: ignore[attr-defined]
    pb.InferenceResponse = (  # type: ignore[attr-defined]
        lambda output_tensors=(): SimpleNamespace(outputs=dict(output_tensors))
    )
    pb.get_input_tensor_by_name = lambda request, name: request.get(name)  # type: ignore[attr-defined]
    return pb


def _model(monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> Any:
    """The model's `TritonPythonModel`, initialised with `tokenizer`."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    spec = importlib.util.spec_from_file_location("postprocessing_model", MODEL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: tokenizer))
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {"tokenizer_dir": {"string_value": "/t"}}})})
    return model


def _response(model: Any, ids: list[int]) -> bytes:
    """OUTPUT for one streamed response carrying `ids` ([batch 1, beam 1, tokens], as TensorRT-LLM sends)."""
    request = {
        "TOKENS_BATCH": SimpleNamespace(as_numpy=lambda: np.array([[ids]], dtype=np.int32)),
        "SEQUENCE_LENGTH": SimpleNamespace(as_numpy=lambda: np.array([[len(ids)]], dtype=np.int32)),
    }
    (value,) = model.execute([request])[0].outputs["OUTPUT"].reshape(-1)
    return bytes(value)


def _streamed(model: Any, ids: list[int]) -> str:
    """The text of a stream of one token a response: the responses' bytes, joined, as UTF-8."""
    return b"".join(_response(model, [i]) for i in ids).decode()


@pytest.mark.skipif(not SMOLLM2.exists(), reason=f"{SMOLLM2} is missing: run `make setup`")
def test_a_character_split_across_streamed_tokens_is_exact_with_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 writes the emoji as three tokens; each decoded in a response of its own gave U+FFFD."""
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2, local_files_only=True)
    model = _model(monkeypatch, tokenizer)
    assert tokenizer(EMOJI, add_special_tokens=False)["input_ids"] == [10813, 242, 218]
    assert _streamed(model, [10813, 242, 218]) == EMOJI
    text = "héllo 日本語 done. It 's  spaced , isn't it ?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert _streamed(model, ids) == text  # no clean-up of " ," and " 's", as sluice's own engine
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    whole = _response(model, [int(t) for t in chat]).decode()  # a non-streaming response: special tokens skipped
    assert whole == tokenizer.decode(chat, skip_special_tokens=True)


def _sentencepiece() -> PreTrainedTokenizerFast:
    """A Llama 2-style tokenizer: "▁" word boundaries, byte fallback for what the vocabulary lacks."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "H", "e", "l", "o", "w", "r", "d", "▁Hello", "▁world"):
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_fallback_tokens_stream_as_their_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = _sentencepiece()
    model = _model(monkeypatch, tokenizer)
    ids = tokenizer(f"Hello {EMOJI} world", add_special_tokens=False)["input_ids"]
    assert len(ids) > 5  # the emoji is four byte tokens
    assert _streamed(model, ids) == f" Hello {EMOJI} world"  # the first word keeps its space: it follows the prompt
    assert _streamed(model, [*ids, tokenizer.eos_token_id]) == f" Hello {EMOJI} world"  # special tokens: nothing


def test_a_tokenizer_whose_tokens_do_not_give_the_text_back_fails_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """WordPiece ("##" continuations, spaces the decoder adds): refused at load, not garbled per response."""
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "##s": 2, ",": 3}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    with pytest.raises(RuntimeError, match="cannot stream"):
        _model(monkeypatch, PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]"))
