"""The triton backend against the real bundled Triton (nvidia-pytriton's tritonserver) serving sluice_llm.

The server is started once for this module from infra/triton/triton.sh on free ports, with a model
repository of two models: the real `sluice_llm` (triton_models/sluice_llm) and `sluice_llm_faulty`, the
same model.py over the same weights with a config whose RMSNorm epsilon is -1e30, so every forward pass
yields NaN logits and a sampled step fails inside the engine (a real model error, no fault hook).
Skipped, with the reason, where `make setup` has not built .venv-triton or converted the model.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from transformers import AutoTokenizer
from tritonclient.grpc import InferInput
from tritonclient.grpc.aio import InferenceServerClient

from pipeline.backends.base import Delta, GenerationRequest, Message
from pipeline.backends.errors import Cancelled, InvalidRequest, ModelError
from pipeline.backends.triton import TritonBackend
from pipeline.models import MODEL_DIRNAME
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "infra" / "triton" / "triton.sh"
MODEL = ROOT / ".cache" / "models" / MODEL_DIRNAME

pytestmark = [
    pytest.mark.skipif(
        not (ROOT / ".venv-triton" / ".installed").exists(),
        reason="the Triton server's environment .venv-triton is not built: run `make setup`",
    ),
    pytest.mark.skipif(not MODEL.exists(), reason=f"{MODEL} is missing: run `make setup`"),
]


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A running server: its gRPC address and its log file."""
    base = tmp_path_factory.mktemp("triton")
    repo, state = base / "repo", base / "state"
    repo.mkdir()
    (repo / "sluice_llm").symlink_to(ROOT / "triton_models" / "sluice_llm")
    faulty_weights = base / "faulty-weights"
    faulty_weights.mkdir()
    for item in MODEL.iterdir():
        if item.name != "config.json":
            (faulty_weights / item.name).symlink_to(item)
    config = json.loads((MODEL / "config.json").read_text())
    (faulty_weights / "config.json").write_text(json.dumps({**config, "rms_norm_eps": -1e30}))
    faulty = repo / "sluice_llm_faulty"
    (faulty / "1").mkdir(parents=True)
    (faulty / "1" / "model.py").symlink_to(ROOT / "triton_models" / "sluice_llm" / "1" / "model.py")
    text = (ROOT / "triton_models" / "sluice_llm" / "config.pbtxt").read_text()
    text = text.replace('name: "sluice_llm"', 'name: "sluice_llm_faulty"')
    text = re.sub(r'(key: "model_dir"\s*value: \{ string_value: )""', rf'\1"{faulty_weights}"', text)
    (faulty / "config.pbtxt").write_text(text)
    for name in ("preprocessing", "postprocessing"):  # the TensorRT-LLM ensemble's tokenizer models, on CPU
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").symlink_to(ROOT / "triton_models" / name / "1" / "model.py")
        text = (ROOT / "triton_models" / name / "config.pbtxt").read_text()
        text = re.sub(r'(key: "tokenizer_dir"\s*value \{\s*string_value: )"[^"]*"', rf'\1"{MODEL}"', text)
        (repo / name / "config.pbtxt").write_text(text)
    grpc_port, http_port = free_port(), free_port()
    models = ["sluice_llm", "sluice_llm_faulty", "preprocessing", "postprocessing"]
    start = [SCRIPT, "start", state, str(grpc_port), str(http_port), repo, *models]
    try:
        subprocess.run(start, check=True, timeout=360)
        yield f"127.0.0.1:{grpc_port}", state / "triton.log"
    finally:
        subprocess.run([SCRIPT, "stop", state], check=True, timeout=60)


@pytest_asyncio.fixture(loop_scope="session")
async def backend(triton: tuple[str, Path]) -> AsyncIterator[TritonBackend]:
    backend = TritonBackend(triton[0], "sluice_llm", name="triton-test", timeout_s=60.0)
    yield backend
    await backend.aclose()


def _chat(rid: str, text: str, **kwargs: object) -> GenerationRequest:
    return GenerationRequest(rid, messages=(Message("user", text),), **kwargs)  # type: ignore[arg-type]


async def _collect(backend: TritonBackend, request: GenerationRequest) -> list[Delta]:
    return [delta async for delta in backend.generate(request)]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stream_arrives_in_deltas_and_ends_once_with_usage(backend: TritonBackend) -> None:
    deltas = await _collect(backend, _chat("stream-1", "Name three colours.", max_tokens=24))
    assert len(deltas) > 3  # streamed, not one final blob
    assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    last = deltas[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.prompt_tokens is not None and last.prompt_tokens > 5
    assert last.completion_tokens is not None and 1 <= last.completion_tokens <= 24
    assert "".join(d.text for d in deltas).strip()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_completion_prompt_honours_max_tokens_and_stop_words(backend: TritonBackend) -> None:
    long = await _collect(backend, GenerationRequest("len-1", prompt="The numbers from one to twenty:", max_tokens=6))
    assert long[-1].finish_reason == "length" and long[-1].completion_tokens == 6
    text = "".join(d.text for d in long)
    stop = text.strip().split()[1]  # a word the greedy answer is known to contain
    stopped = await _collect(
        backend, GenerationRequest("stop-1", prompt="The numbers from one to twenty:", max_tokens=6, stop=(stop,))
    )
    assert stopped[-1].finish_reason == "stop"
    assert stop not in "".join(d.text for d in stopped)


@pytest.mark.asyncio(loop_scope="session")
async def test_resume_text_continues_where_the_delivered_text_ends(backend: TritonBackend) -> None:
    prompt = "Write one sentence about the sea."
    whole = await _collect(backend, _chat("resume-full", prompt, max_tokens=20))
    delivered = "".join(d.text for d in whole[:5])
    rest = await _collect(backend, _chat("resume-rest", prompt, max_tokens=20, resume_text=delivered))
    assert delivered + "".join(d.text for d in rest) == "".join(d.text for d in whole)
    assert backend.resumes


@pytest.mark.asyncio(loop_scope="session")
async def test_32_concurrent_streams_share_the_batch_and_each_ends_exactly_once(triton: tuple[str, Path]) -> None:
    """At the protocol level: each stream gets exactly one response flagged final, as its last, then the
    server closes it; the streams run in one continuous batch, not one after another."""
    client = InferenceServerClient(triton[0])
    first: list[float] = []
    ends: list[float] = []

    async def one(i: int) -> tuple[int, bool]:
        inputs = _raw_inputs(f"Say something about the number {i}.", max_tokens=12)
        responses, finals, last_final = 0, 0, False
        async for result, error in client.stream_infer(_once({"model_name": "sluice_llm", "inputs": inputs})):
            assert error is None, error
            responses += 1
            if responses == 1:
                first.append(time.perf_counter())
            last_final = result.get_response().parameters["triton_final_response"].bool_param
            finals += last_final
        ends.append(time.perf_counter())  # the server closed the stream
        return finals, last_final

    try:
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 240)
    finally:
        await client.close()
    assert results == [(1, True)] * 32
    # Served in turn, the last stream's first token would come after 31 streams ended; in one batch it comes
    # before half of them have (a stream whose first token is its end-of-sequence ends at once).
    assert len(first) == 32 and max(first) < sorted(ends)[16]


@pytest.mark.asyncio(loop_scope="session")
async def test_32_concurrent_backend_streams_each_have_one_ending(backend: TritonBackend) -> None:
    requests = [_chat(f"many-{i}", f"Count to {i % 5 + 2}.", max_tokens=10) for i in range(32)]
    results = await asyncio.wait_for(asyncio.gather(*(_collect(backend, r) for r in requests)), 240)
    for deltas in results:
        assert sum(d.finish_reason is not None for d in deltas) == 1 and deltas[-1].finish_reason is not None


@pytest.mark.asyncio(loop_scope="session")
async def test_cancel_reaches_the_model_within_a_step(backend: TritonBackend, triton: tuple[str, Path]) -> None:
    rid = "cancel-me-1"
    stream = backend.generate(_chat(rid, "Tell me a very long story about a dragon.", max_tokens=400))
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    cancelled_at = time.perf_counter()
    await backend.cancel(rid)
    with pytest.raises(Cancelled):
        await stream.__anext__()
    assert time.perf_counter() - cancelled_at < 1.0
    await stream.aclose()
    line = await _log_line(triton[1], rf"request '{rid}' cancelled after (\d+) tokens")
    generated = int(line.group(1))
    assert generated <= received + 3  # the sequence left the batch within a step of the cancel, not at 400
    # the server keeps serving after a cancellation
    after = await _collect(backend, _chat("after-cancel", "Hi", max_tokens=4))
    assert after[-1].finish_reason is not None


@pytest.mark.asyncio(loop_scope="session")
async def test_closing_the_iterator_cancels_the_request_in_the_model(
    backend: TritonBackend, triton: tuple[str, Path]
) -> None:
    rid = "walk-away-1"
    stream = backend.generate(_chat(rid, "Describe the ocean in great detail.", max_tokens=400))
    await stream.__anext__()
    await stream.aclose()  # the consumer left: the gRPC call is cancelled
    line = await _log_line(triton[1], rf"request '{rid}' cancelled after (\d+) tokens")
    assert int(line.group(1)) < 50


@pytest.mark.asyncio(loop_scope="session")
async def test_a_failed_model_step_is_a_retriable_model_error(triton: tuple[str, Path]) -> None:
    faulty = TritonBackend(triton[0], "sluice_llm_faulty", name="faulty", timeout_s=60.0)
    try:
        with pytest.raises(ModelError) as caught:
            await _collect(faulty, _chat("boom-1", "Hello", max_tokens=8, temperature=0.7, seed=1))
    finally:
        await faulty.aclose()
    assert caught.value.retriable
    assert "model step failed" in str(caught.value)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_refused_request_is_an_invalid_request(backend: TritonBackend) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await _collect(backend, _chat("too-long-1", "Hello", max_tokens=100_000))
    assert not caught.value.retriable
    assert "exceeds the context" in str(caught.value)


@pytest.mark.asyncio(loop_scope="session")
async def test_an_unknown_model_is_a_model_error(triton: tuple[str, Path]) -> None:
    missing = TritonBackend(triton[0], "no_such_model", name="missing", timeout_s=10.0)
    try:
        with pytest.raises(ModelError):
            await _collect(missing, _chat("missing-1", "Hello", max_tokens=4))
    finally:
        await missing.aclose()


@pytest.mark.asyncio(loop_scope="session")
async def test_stream_false_returns_the_whole_completion_in_one_final_response(triton: tuple[str, Path]) -> None:
    client = InferenceServerClient(triton[0])
    try:
        inputs = _raw_inputs("Say hello.", max_tokens=8, stream=False)
        responses = [
            (result, error) async for result, error in client.stream_infer(_once({"model_name": "sluice_llm", "inputs": inputs}))
        ]
    finally:
        await client.close()
    assert len(responses) == 1 and responses[0][1] is None
    result = responses[0][0]
    assert result.get_response().parameters["triton_final_response"].bool_param
    assert result.as_numpy("text_output").reshape(-1)[0].decode().strip()
    assert result.as_numpy("finish_reason").reshape(-1)[0] in (b"stop", b"length")


@pytest.mark.asyncio(loop_scope="session")
async def test_the_tensorrt_llm_tokenizer_models_round_trip(triton: tuple[str, Path]) -> None:
    """preprocessing and postprocessing (triton_models/, the GPU ensemble's Python steps) on the real server
    with the default model's tokenizer: the chat template, TensorRT-LLM's word-list layout, decoding."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    chat = [{"role": "user", "content": "Hello there"}]
    client = InferenceServerClient(triton[0])
    try:
        pre = await client.infer("preprocessing", _tensors({
            "QUERY": np.array([[b""]], dtype=np.object_),
            "MESSAGES": np.array([[json.dumps(chat).encode()]], dtype=np.object_),
            "REQUEST_OUTPUT_LEN": np.array([[9]], dtype=np.int32),
            "STOP_WORDS_DICT": np.array([[b"END", b"Stop here"]], dtype=np.object_),
        }))
        ids = pre.as_numpy("INPUT_ID")
        post = await client.infer("postprocessing", _tensors({
            "TOKENS_BATCH": ids.reshape(1, 1, -1).astype(np.int32),
            "SEQUENCE_LENGTH": np.array([[ids.shape[1]]], dtype=np.int32),
        }))
    finally:
        await client.close()
    expected = [int(t) for t in tokenizer.apply_chat_template(chat, add_generation_prompt=True)]
    assert ids.reshape(-1).tolist() == expected
    assert pre.as_numpy("REQUEST_INPUT_LEN").tolist() == [[len(expected)]]
    assert pre.as_numpy("REQUEST_OUTPUT_LEN").tolist() == [[9]]
    assert pre.as_numpy("OUT_END_ID").tolist() == [[tokenizer.eos_token_id]]
    words = [tokenizer("END", add_special_tokens=False)["input_ids"], tokenizer("Stop here", add_special_tokens=False)["input_ids"]]
    stop = pre.as_numpy("STOP_WORDS_IDS")[0]
    flat = words[0] + words[1]
    assert stop[0, : len(flat)].tolist() == flat and stop[1, :2].tolist() == [len(words[0]), len(flat)]
    assert pre.as_numpy("BAD_WORDS_IDS").tolist() == [[[0], [-1]]]  # none given
    text = post.as_numpy("OUTPUT").reshape(-1)[0].decode()
    assert text == tokenizer.decode(expected, skip_special_tokens=True)


def _tensors(values: dict[str, np.ndarray]) -> list[InferInput]:
    kinds = {"O": "BYTES", "i": "INT32"}
    inputs = []
    for name, array in values.items():
        tensor = InferInput(name, list(array.shape), kinds[array.dtype.kind])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _raw_inputs(text: str, *, max_tokens: int, stream: bool = True) -> list[InferInput]:
    """TensorRT-LLM ensemble-style inputs, as any Triton LLM client sends them."""
    values = {
        "text_input": np.array([[text.encode()]], dtype=np.object_),
        "max_tokens": np.array([[max_tokens]], dtype=np.int32),
        "stream": np.array([[stream]], dtype=np.bool_),
    }
    inputs = []
    for name, array in values.items():
        tensor = InferInput(name, list(array.shape), {"O": "BYTES", "i": "INT32", "b": "BOOL"}[array.dtype.kind])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


async def _once(payload: dict[str, object]) -> AsyncIterator[dict[str, object]]:
    yield payload


async def _log_line(log: Path, pattern: str, timeout_s: float = 5.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        match = re.search(pattern, log.read_text(errors="replace"))
        if match is not None:
            return match
        if time.monotonic() > deadline:
            raise AssertionError(f"no line matching {pattern!r} in {log}")
        await asyncio.sleep(0.05)
