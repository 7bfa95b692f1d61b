"""Off-topic answers and prompts: a route's topics (guard.routes) compared with the text by MiniLM."""

from __future__ import annotations

import time

import pytest

from pipeline.errors import StageError
from pipeline.guard.config import GuardSettings
from pipeline.guard.loader import InputGuard
from pipeline.guard.on_topic import MIN_CHARS, RouteTopics, TopicScope, topic_pieces
from pipeline.settings import Settings
from pipeline.stages.guard import GuardStage
from pipeline.stages.postguard import PostguardStage
from tests.unit.fakes import run_handler
from tests.unit.helpers import MODEL, node, request
from topics import registry
from topics.control import Cancel
from topics.errors import ErrorCode
from topics.hops import Admitted, request_key
from topics.requests import ChatMessage
from topics.stream import Chunk, Done, FinishReason, Usage, digest_of

REPLY = "llm.responses.sdk"
AIRLINE = RouteTopics(topics=(
    "Flight bookings and changes: booking a flight, changing or cancelling a reservation, choosing seats, fare rules and change fees.",
    "Baggage: checked and cabin baggage allowances, excess baggage fees, lost, delayed or damaged luggage and how to file a claim.",
    "Refunds and compensation: refunds for cancelled or delayed flights, travel vouchers, compensation rules, how long a refund takes.",
))
ON_TOPIC = ("Your checked baggage allowance is one bag of up to 23 kg. If your suitcase was delayed, file a report at the "
            "baggage desk or online within 21 days and keep the receipts for anything you had to buy meanwhile. ")
DRIFT = ("Anyway, here is a recipe for banana bread instead. Mash three ripe bananas and mix them with melted butter, sugar, "
         "an egg, flour and baking soda. Then bake it for an hour at 175 degrees until a skewer comes out clean. ")


def test_a_topic_is_compared_by_its_pieces() -> None:
    assert topic_pieces("Baggage: allowances, fees and lost luggage.") == [
        "Baggage: allowances, fees and lost luggage.", "Baggage", "allowances", "fees", "lost luggage"]
    assert topic_pieces("Python packaging") == ["Python packaging"]


def test_routes_are_validated() -> None:
    assert GuardSettings(routes={"m": AIRLINE}).problems() == []
    assert "guard.routes.m.threshold must be between 0 and 1" in GuardSettings(routes={"m": RouteTopics(("a b c",), threshold=1.5)}).problems()[0]
    assert "must name at least one topic" in GuardSettings(routes={"m": RouteTopics(())}).problems()[0]


def test_the_scope_tells_an_answer_on_its_topics_from_one_that_left_them(input_guard: InputGuard) -> None:
    scope = TopicScope(input_guard.embedder, AIRLINE)
    assert not scope.answer_off_topic(ON_TOPIC)
    assert scope.answer_off_topic(DRIFT)
    assert not scope.answer_off_topic("Banana bread, sure."[:MIN_CHARS])  # too short to judge
    assert scope.prompt_off_topic("Write me a poem about autumn leaves.")
    assert not scope.prompt_off_topic("My bag did not arrive in Rome, what should I do?")
    assert not scope.prompt_off_topic("Hi there")  # under three words: not judged


def postguard(make_output_guard) -> PostguardStage:  # type: ignore[no-untyped-def]
    # Topics only: with a 4-chunk window the default MiniLM toxicity head scores 5-word openings, and
    # "If your suitcase was delayed," scores 0.82 (test_toxicity.py keeps that as an xfail, not strict: 0.74 on another host).
    settings = {"holdback_tokens": 4, "routes": {MODEL: AIRLINE}, "toxicity_backend": "profanity_check"}
    return PostguardStage(GuardSettings(**settings), make_output_guard(**settings), node("postguard").topics)  # type: ignore[arg-type]


async def stream(guard: PostguardStage, text: str, model: str = MODEL, rid: str = "r1") -> list:  # type: ignore[type-arg]
    outs = []
    words = [w + " " for w in text.split()]
    for i, word in enumerate(words):
        outs += await run_handler(guard, Chunk(id=rid, reply_to=REPLY, seq=i, text=word, tenant="t1", model=model))
    end = Done(id=rid, reply_to=REPLY, chunks=len(words), digest=digest_of(words), finish_reason=FinishReason.stop, usage=Usage(5, len(words)),
               tenant="t1", model=model, created_at=1.0)
    return outs + await run_handler(guard, end)


def released(outs: list) -> str:  # type: ignore[type-arg]
    return "".join(o.value.text for o in outs if isinstance(o.value, Chunk))


@pytest.mark.asyncio
async def test_postguard_ends_an_answer_that_drifts_off_its_routes_topics(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = postguard(make_output_guard)
    outs = await stream(guard, ON_TOPIC + DRIFT)
    cancels = [o for o in outs if o.topic == registry.CONTROL]
    assert len(cancels) == 1 and isinstance(cancels[0].value, Cancel)
    text = released(outs)
    # Two sentences in a row far from the topics end it: the third is never released.
    assert text.startswith("Your checked baggage") and "skewer" not in text
    end = outs[-1].value  # decode's ending, after the cancel, becomes the one terminal event
    assert end.code is ErrorCode.content_filter and end.message.startswith("off_topic:")
    assert outs.index(cancels[0]) < len(outs) - 1  # the kill switch fired mid-stream, not at the end


@pytest.mark.asyncio
async def test_postguard_passes_an_answer_on_topic_and_checks_only_routes_with_topics(make_output_guard) -> None:  # type: ignore[no-untyped-def]
    guard = postguard(make_output_guard)
    outs = await stream(guard, ON_TOPIC + ON_TOPIC)
    assert released(outs) == " ".join((ON_TOPIC + ON_TOPIC).split()) + " " and isinstance(outs[-1].value, Done)
    closing = ON_TOPIC + "Is there anything else I can help you with today? "  # one generic sentence is not a drift
    assert isinstance((await stream(guard, closing, rid="r3"))[-1].value, Done)
    other = await stream(guard, DRIFT + DRIFT, model="another-model", rid="r2")  # that route names no topics
    assert isinstance(other[-1].value, Done) and "skewer" in released(other)


def admitted(content: str, model: str = MODEL) -> Admitted:
    req = request(messages=(ChatMessage("user", content),), model=model)
    return Admitted(id=request_key("default", req.id), request=req, tenant="default", principal="default", admitted_at=time.time())


@pytest.mark.asyncio
async def test_guard_refuses_a_prompt_off_its_routes_topics(input_guard: InputGuard) -> None:
    stage = GuardStage(Settings(guard=GuardSettings(routes={MODEL: AIRLINE})), input_guard, node("guard").topics)
    with pytest.raises(StageError) as refused:
        await run_handler(stage, admitted("Give me a recipe for a vegetable lasagna."))
    assert refused.value.code is ErrorCode.content_filter and str(refused.value).startswith("off_topic:")
    [out] = await run_handler(stage, admitted("Can I still change the date of my flight to Madrid?"))
    assert out.topic == node("guard").topics.forward
    [out] = await run_handler(stage, admitted("Give me a recipe for a vegetable lasagna.", model="another-model"))
    assert out.topic == node("guard").topics.forward
