import msgspec
import pytest

from pipeline.errors import StageError, Undeliverable
from pipeline.stages.ingest import IngestStage
from tests.unit.fakes import run_handler
from tests.unit.helpers import SETTINGS, request
from topics import registry
from topics.envelope import Envelope
from topics.errors import ErrorCode
from topics.requests import ChatMessage, Sampling

STAGE = IngestStage(SETTINGS)


@pytest.mark.asyncio
async def test_admits_a_valid_request_with_its_timing() -> None:
    [out] = await run_handler(STAGE, request())
    assert out.topic == registry.ADMITTED and out.key == "r1"
    assert isinstance(out.value, Envelope)
    assert out.value.principal == "default" and "ingest" in out.value.timings


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"sampling": Sampling(max_tokens=SETTINGS.limits.max_tokens_cap + 1)}, ErrorCode.invalid_request),
        ({"messages": (ChatMessage(role="user", content="x" * (SETTINGS.limits.max_prompt_bytes + 1)),)}, ErrorCode.invalid_request),
        ({"messages": (), "prompt": None}, ErrorCode.invalid_request),
        ({"prompt": "both given"}, ErrorCode.invalid_request),
        ({"model": "gpt-17"}, ErrorCode.not_found),
        ({"created_at": 1.0}, ErrorCode.deadline_exceeded),
    ],
)
@pytest.mark.asyncio
async def test_refuses_with_a_terminal_code(overrides: dict[str, object], code: ErrorCode) -> None:
    with pytest.raises(StageError) as caught:
        await run_handler(STAGE, request(**overrides))
    assert caught.value.code is code


@pytest.mark.asyncio
async def test_counts_prompt_bytes_not_characters() -> None:
    limit = SETTINGS.limits.max_prompt_bytes
    emoji = "\N{GRINNING FACE}"  # 4 bytes in UTF-8
    with pytest.raises(StageError):
        await run_handler(STAGE, request(messages=(ChatMessage(role="user", content=emoji * (limit // 4 + 1)),)))


@pytest.mark.asyncio
async def test_an_unconfigured_reply_topic_is_undeliverable() -> None:
    with pytest.raises(Undeliverable):
        await run_handler(STAGE, request(reply_to=registry.ADMITTED))


def test_request_ids_are_restricted_to_a_safe_alphabet() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**msgspec.to_builtins(request()), "id": "a b\n"}, type(request()))
