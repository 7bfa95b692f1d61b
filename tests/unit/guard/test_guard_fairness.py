"""The guard stage without head-of-line blocking: a prompt that cannot fit its model's context is
refused before any guard work; long texts are guarded in bounded slices with findings at the right
offsets; one tenant's large prompts do not hold up another tenant's small one."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.errors import StageError
from pipeline.guard.config import GuardSettings
from pipeline.guard.context_limit import ContextLimit
from pipeline.guard.loader import InputGuard
from pipeline.guard.slices import PII_SLICE, Piece, PieceVerdict, TextCheck, pieces_of
from pipeline.settings import Settings
from pipeline.stages.guard import GuardStage
from tests.unit.fakes import run_handler
from tests.unit.helpers import node, request
from topics.errors import ErrorCode
from topics.hops import Admitted, request_key
from topics.requests import ChatMessage, Sampling


def admitted(text: str, tenant: str = "default", max_tokens: int = 128) -> Admitted:
    req = request(messages=(ChatMessage("user", text),), tenant=tenant, sampling=Sampling(max_tokens=max_tokens))
    return Admitted(id=request_key(tenant, req.id), request=req, tenant=tenant, principal=tenant, admitted_at=time.time(), timings={})


class GuardNotToBeCalled:
    def run(self, pieces: list[Piece]) -> list[PieceVerdict]:
        raise AssertionError("the guard ran on a request the context check should have refused")


@pytest.mark.asyncio
async def test_a_prompt_over_the_models_context_is_refused_before_the_guard_runs() -> None:
    settings = Settings()
    stage = GuardStage(settings, GuardNotToBeCalled(), node("guard").topics)  # type: ignore[arg-type]
    words = "alpha beta gamma delta " * 2500  # 10,000 words: more tokens than SmolLM2's 8,192
    with pytest.raises(StageError) as caught:
        await run_handler(stage, admitted(words))
    assert caught.value.code is ErrorCode.invalid_request and caught.value.message.startswith("context_length:")
    assert "alpha" not in caught.value.message


@pytest.mark.asyncio
async def test_max_tokens_counts_towards_the_context() -> None:
    limit = ContextLimit.from_settings(Settings().backends, Settings().model_cache)
    text = "alpha beta gamma delta " * 1500  # ~6,000 tokens
    tokens = limit.check(admitted(text).request)
    assert tokens is not None and 4000 < tokens < 8192
    with pytest.raises(StageError):
        limit.check(admitted(text, max_tokens=8192 - tokens + 1).request)


def test_long_texts_are_cut_into_bounded_pieces() -> None:
    text = "word " * 2000
    pieces = pieces_of(TextCheck(text, True))
    assert all(len(p.text) <= PII_SLICE for p in pieces if p.pii)
    assert all(len(p.text) <= 1000 for p in pieces if p.injection)
    covered = sorted((p.offset, p.offset + len(p.text)) for p in pieces if p.pii)
    assert covered[0][0] == 0 and covered[-1][1] == len(text)
    assert all(b[0] < a[1] for a, b in zip(covered, covered[1:]))  # consecutive slices overlap


@pytest.mark.asyncio
async def test_pii_in_a_long_text_is_found_at_its_offsets_even_across_a_slice_boundary(input_guard: InputGuard) -> None:
    stage = GuardStage(Settings(guard=GuardSettings(injection_threshold=1.0)), input_guard, node("guard").topics, context=ContextLimit({}))
    filler = "The quarterly report covers revenue and costs. " * 19  # 893 characters
    text = filler + "Mail jane.doe@example.org now. " + filler * 3 + "Or call +44 20 7946 0958 today."
    boundary = PII_SLICE - 40  # an address straddling the first slice's end
    text = text[:boundary] + " bob.smith@example.com " + text[boundary:]
    [out] = await run_handler(stage, admitted(text))
    redacted = out.value.request.messages[0].content
    assert "@example" not in redacted and "7946" not in redacted
    assert redacted.count("<EMAIL_") == 2 and "<PHONE_1>" in redacted


@pytest.mark.asyncio
async def test_a_small_request_does_not_wait_behind_another_tenants_large_ones(input_guard: InputGuard) -> None:
    stage = GuardStage(Settings(guard=GuardSettings(injection_threshold=1.0)), input_guard, node("guard").topics, context=ContextLimit({}))
    large = "Call maria.lopez@example.com or +1 415-555-0134 about card 4111 1111 1111 1111. " * 100  # 8 KB
    finished: list[str] = []

    async def send(text: str, tenant: str) -> None:
        await run_handler(stage, admitted(text, tenant=tenant))
        finished.append(tenant)

    big = [asyncio.create_task(send(large, "bulk")) for _ in range(2)]
    await asyncio.sleep(0.2)  # the large ones are being guarded
    await send("What is the capital of France?", "interactive")
    await asyncio.gather(*big)
    assert finished[0] == "interactive", finished
