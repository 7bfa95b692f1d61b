import asyncio
import time
from dataclasses import replace

import msgspec
import pytest

from pipeline.errors import StageError, Undeliverable
from pipeline.gateway.build import memory_gateway
from pipeline.gateway.config import ModelPrice
from pipeline.gateway.gateway import Principal
from pipeline.gateway.limits import Scope
from pipeline.handling import Handling
from pipeline.stages import ingest
from pipeline.stages.emit import EmitStage
from pipeline.stages.ingest import IngestStage
from pipeline.state import MemoryStateStore
from tests.unit.fakes import HeldAcks, record_of, run_handler
from tests.unit.gateway.helpers import rig
from tests.unit.helpers import SETTINGS, node, request
from topics import codec, registry
from topics.errors import ErrorCode
from topics.hops import Admitted
from topics.requests import ChatMessage, Request, Sampling
from topics.stream import Done, Failed, FinishReason, StreamEvent, Usage
from topics.usage import UsageRecord

INGEST = node("ingest")
STAGE = IngestStage(SETTINGS, INGEST.topics)


async def refusal(stage: IngestStage, message: Request) -> tuple[ErrorCode, str]:
    """How ingest refused `message`: the code, and the tenant its terminal event names ("": nobody was
    authenticated; the runner then ends the request under the client's id with no tenant)."""
    with pytest.raises(StageError) as refused:
        await run_handler(stage, message)
    return refused.value.code, refused.value.tenant or ""


@pytest.mark.asyncio
async def test_admits_a_valid_request_with_its_timing() -> None:
    [out] = await run_handler(STAGE, request("admit-me"))
    assert out.topic == registry.ADMITTED and out.key == "default/admit-me"
    assert isinstance(out.value, Admitted) and out.value.id == "default/admit-me"
    assert out.value.tenant == "default" and out.value.request.api_key is None
    assert out.value.principal == "default" and "ingest" in out.value.timings


@pytest.mark.asyncio
async def test_the_id_is_namespaced_by_the_authenticated_tenant_not_the_claim() -> None:
    [out] = await run_handler(IngestStage(SETTINGS, INGEST.topics), request("x1", tenant="victim"))
    assert out.value.id == "default/x1" and out.value.tenant == "default"


@pytest.mark.asyncio
async def test_a_reused_id_with_other_content_is_refused_and_a_redelivery_is_not() -> None:
    stage = IngestStage(SETTINGS, INGEST.topics)
    first = request("same")
    await run_handler(stage, first)
    [again] = await run_handler(stage, first)  # the same record delivered twice
    assert again.value.id == "default/same"
    other = request("same", messages=(ChatMessage(role="user", content="other"),))
    assert await refusal(stage, other) == (ErrorCode.invalid_request, "default")  # id "same": not default/same's end


class Later:
    """Stands in for the `time` module of ingest: the clock `seconds` ahead."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def time(self) -> float:
        return time.time() + self.seconds


@pytest.mark.asyncio
async def test_a_copy_of_a_request_passed_on_is_not_refused_by_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # A group sent back to an old offset shows ingest requests it passed on long ago; their endings are
    # known downstream (emit drops a repeat under their id), so a refusal now would be a second terminal.
    stage, first = IngestStage(SETTINGS, INGEST.topics), request("old")
    await run_handler(stage, first)
    monkeypatch.setattr(ingest, "time", Later(first.deadline_s + 60))
    [again] = await run_handler(stage, first)
    assert again.value.id == "default/old"
    late = request("new-but-late", created_at=time.time() - first.deadline_s - 1)  # another one still is refused
    assert await refusal(stage, late) == (ErrorCode.deadline_exceeded, "default")


@pytest.mark.asyncio
async def test_a_request_refused_by_its_deadline_is_refused_again_when_seen_again() -> None:
    stage, late = IngestStage(SETTINGS, INGEST.topics), request("late", created_at=1.0)
    for _ in range(2):  # never claimed: the copy gets the same refusal, which emit drops as a repeat
        assert await refusal(stage, late) == (ErrorCode.deadline_exceeded, "default")


class Claims(MemoryStateStore):
    def __init__(self) -> None:
        super().__init__()
        self.claiming = asyncio.Event()

    async def claim(self, key: str, field: str, value: bytes) -> bool:
        self.claiming.set()
        return await super().claim(key, field, value)


class AdmitsOnceClaimed:
    """A gateway whose rate limits answer only once the id's claim has been sent, and refuse if told."""

    def __init__(self, store: Claims, refuse: bool = False) -> None:
        self._gateway, self._store, self._refuse = memory_gateway(SETTINGS), store, refuse

    async def authenticate(self, message: Request) -> Principal:
        return await self._gateway.authenticate(message)

    async def admit(self, message: Request, principal: Principal | None) -> tuple[Request, Principal]:
        await asyncio.wait_for(self._store.claiming.wait(), 2.0)
        if self._refuse:
            raise StageError(ErrorCode.rate_limited, "rate limit reached", retry_after_s=1.0)
        return await self._gateway.admit(message, principal)

    async def aclose(self) -> None:
        await self._gateway.aclose()


@pytest.mark.asyncio
async def test_the_ids_claim_and_the_rate_limits_go_out_together() -> None:
    store = Claims()
    stage = IngestStage(SETTINGS, INGEST.topics, AdmitsOnceClaimed(store), store)  # type: ignore[arg-type]
    [out] = await run_handler(stage, request("together"))
    assert out.value.id == "default/together"
    assert (await store.read("default/together")).get("fingerprint")


@pytest.mark.asyncio
async def test_a_refusal_is_what_the_client_hears_even_for_an_id_in_use() -> None:
    store = Claims()
    await run_handler(IngestStage(SETTINGS, INGEST.topics, store=store), request("taken"))
    stage = IngestStage(SETTINGS, INGEST.topics, AdmitsOnceClaimed(store, refuse=True), store)  # type: ignore[arg-type]
    other = request("taken", messages=(ChatMessage(role="user", content="other"),))
    assert await refusal(stage, other) == (ErrorCode.rate_limited, "default")


@pytest.mark.asyncio
async def test_a_refused_request_sent_again_byte_for_byte_is_admitted() -> None:
    store, first = Claims(), request("retried")
    gateway = AdmitsOnceClaimed(store, refuse=True)
    refusing = IngestStage(SETTINGS, INGEST.topics, gateway, store)  # type: ignore[arg-type]
    assert (await refusal(refusing, first))[0] is ErrorCode.rate_limited
    [out] = await run_handler(IngestStage(SETTINGS, INGEST.topics, store=store), first)  # its id stayed claimed
    assert out.value.id == "default/retried"


@pytest.mark.asyncio
async def test_work_cancelled_while_the_limits_are_asked_leaves_no_claim_running() -> None:
    class SlowClaims(Claims):
        async def claim(self, key: str, field: str, value: bytes) -> bool:
            self.claiming.set()
            await asyncio.sleep(3600)  # Redis away
            return True

    class Stuck(AdmitsOnceClaimed):
        async def admit(self, message: Request, principal: Principal | None) -> tuple[Request, Principal]:
            await asyncio.sleep(3600)
            raise AssertionError

    store = SlowClaims()
    task = asyncio.create_task(run_handler(IngestStage(SETTINGS, INGEST.topics, Stuck(store), store), request("revoked")))  # type: ignore[arg-type]
    await asyncio.wait_for(store.claiming.wait(), 2.0)
    task.cancel()  # the partition was revoked
    done, _ = await asyncio.wait([task], timeout=2.0)
    assert done and task.cancelled()


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"sampling": Sampling(max_tokens=SETTINGS.limits.max_tokens_cap + 1)}, ErrorCode.invalid_request),
        ({"messages": (ChatMessage(role="user", content="x" * (SETTINGS.limits.max_prompt_bytes + 1)),)}, ErrorCode.invalid_request),
        ({"messages": (), "prompt": None}, ErrorCode.invalid_request),
        ({"messages": (), "prompt": ""}, ErrorCode.invalid_request),  # the bridge's rule: a backend's error, else
        ({"prompt": "both given"}, ErrorCode.invalid_request),
        ({"model": "gpt-17"}, ErrorCode.not_found),
        ({"sampling": Sampling(stop=tuple(f"s{i}" for i in range(100_000)))}, ErrorCode.invalid_request),  # per token
        ({"sampling": Sampling(stop=("x" * (ingest.MAX_STOP_BYTES + 1),))}, ErrorCode.invalid_request),
        ({"sampling": Sampling(stop=("",))}, ErrorCode.invalid_request),
        ({"deadline_s": 1e15}, ErrorCode.invalid_request),  # every wait "until the deadline" without end
        ({"created_at": time.time() + 1e12}, ErrorCode.invalid_request),
        ({"created_at": 0.0}, ErrorCode.invalid_request),  # a deadline that moved with the clock
        ({"created_at": 1.0}, ErrorCode.deadline_exceeded),
    ],
)
@pytest.mark.asyncio
async def test_refuses_with_a_terminal_code(overrides: dict[str, object], code: ErrorCode) -> None:
    assert (await refusal(STAGE, request(**overrides)))[0] is code


@pytest.mark.asyncio
async def test_counts_prompt_bytes_not_characters() -> None:
    limit = SETTINGS.limits.max_prompt_bytes
    emoji = "\N{GRINNING FACE}"  # 4 bytes in UTF-8
    message = request(messages=(ChatMessage(role="user", content=emoji * (limit // 4 + 1)),))
    assert (await refusal(STAGE, message))[0] is ErrorCode.invalid_request


@pytest.mark.asyncio
async def test_an_unconfigured_reply_topic_is_undeliverable() -> None:
    with pytest.raises(Undeliverable):
        await run_handler(STAGE, request(reply_to=registry.ADMITTED))


def test_request_ids_are_restricted_to_a_safe_alphabet() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**msgspec.to_builtins(request()), "id": "a b\n"}, type(request()))


AUTH_REQUIRED = replace(SETTINGS, gateway=replace(SETTINGS.gateway, auth_required=True))


@pytest.mark.parametrize("overrides", [
    {"model": "gpt-17"},
    {"sampling": Sampling(max_tokens=SETTINGS.limits.max_tokens_cap + 1)},
    {"messages": (), "prompt": None},
])
@pytest.mark.parametrize("api_key", [None, "sk-sluice-" + "x" * 43])
@pytest.mark.asyncio
async def test_with_auth_required_an_unauthenticated_caller_learns_nothing_from_validation(
    overrides: dict[str, object], api_key: str | None
) -> None:
    with pytest.raises(StageError) as caught:
        await run_handler(IngestStage(AUTH_REQUIRED, INGEST.topics), request(api_key=api_key, **overrides))
    assert caught.value.code is ErrorCode.unauthorized
    assert SETTINGS.models[0] not in str(caught.value) and str(SETTINGS.limits.max_tokens_cap) not in str(caught.value)


@pytest.mark.asyncio
async def test_with_auth_required_an_unconfigured_reply_topic_is_still_undeliverable_first() -> None:
    with pytest.raises(Undeliverable):
        await run_handler(IngestStage(AUTH_REQUIRED, INGEST.topics), request(reply_to=registry.ADMITTED))


async def ingest_with_key(**limits: object) -> tuple[IngestStage, str]:
    """Ingest with auth required, on a gateway whose one key belongs to the tenant "acme"."""
    r = rig()
    raw, _ = await r.keys.create("acme", **limits)  # type: ignore[arg-type]
    return IngestStage(AUTH_REQUIRED, INGEST.topics, r.gateway), raw


@pytest.mark.parametrize(("limits", "overrides", "code"), [
    ({"rpm": 1}, {}, ErrorCode.rate_limited),  # the key's one request a minute went to "warm-up"
    ({"models": ("another-model",)}, {}, ErrorCode.forbidden),
    ({}, {"sampling": Sampling(max_tokens=SETTINGS.limits.max_tokens_cap + 1)}, ErrorCode.invalid_request),
    ({}, {"created_at": 1.0}, ErrorCode.deadline_exceeded),
])
@pytest.mark.asyncio
async def test_a_refusal_after_authentication_is_counted_under_the_tenant(
    limits: dict[str, object], overrides: dict[str, object], code: ErrorCode,
) -> None:
    stage, raw = await ingest_with_key(**limits)
    if "rpm" in limits:
        await run_handler(stage, request("warm-up", api_key=raw))
    producer = HeldAcks()
    run = Handling(stage, SETTINGS, producer)  # type: ignore[arg-type]
    task = asyncio.create_task(run.process(record_of(request("refused", api_key=raw, **overrides), registry.REQUESTS), None))
    while not task.done():
        producer.release()
        await asyncio.sleep(0.01)
    [(_, [value])] = producer.calls
    refused = codec.decode(value, StreamEvent)
    assert isinstance(refused, Failed) and refused.code is code and refused.tenant == "acme"
    # the client's own id, as before authentication: it reaches the client and ends no request "acme/refused"
    assert refused.id == "refused"
    if code is ErrorCode.rate_limited:
        assert refused.retry_after_s is not None and refused.rate_limit is not None
    outs = await run_handler(EmitStage(SETTINGS, node("emit").topics), refused)
    [usage] = [o for o in outs if isinstance(o.value, UsageRecord)]
    assert (usage.key, usage.value.tenant, usage.value.outcome) == ("acme", "acme", code.value)


@pytest.mark.asyncio
async def test_a_deadline_within_max_deadline_s_of_now_is_admitted_though_created_at_is_ahead() -> None:
    """(Times taken when the test runs: a parameter's `time.time()` is taken at collection, minutes
    before a full run reaches it, and a CI run admitted what it meant to refuse.)"""
    limit = SETTINGS.limits.max_deadline_s
    assert (await refusal(STAGE, request("ahead-max", created_at=time.time() + 299, deadline_s=limit)))[0] is ErrorCode.invalid_request
    [out] = await run_handler(STAGE, request("ahead-ok", created_at=time.time() + 299, deadline_s=limit - 300))
    assert out.value.id == "default/ahead-ok"
    assert (await refusal(STAGE, request("ahead-no", created_at=time.time() + 299, deadline_s=limit - 290)))[0] is ErrorCode.invalid_request
    # a sender's clock a second ahead, deadline_s at the maximum (a batch line may have it): admitted
    [out] = await run_handler(STAGE, request("ahead-a-second", created_at=time.time() + 1, deadline_s=limit))
    assert out.value.id == "default/ahead-a-second"


@pytest.mark.asyncio
async def test_a_request_refused_under_a_running_ones_id_leaves_its_charge_alone() -> None:
    """The reviewer's case through ingest: another request under a running one's id, with a 5 s deadline,
    refused (id in use), had replaced the first's ticket by one that lived 65 s: the first, ending 120 s
    in, was charged 0.0 (2.0 without the second)."""
    r = rig(prices={SETTINGS.models[0]: ModelPrice(prompt_per_1k=100.0, completion_per_1k=100.0)})
    r.clock.now = time.time()
    raw, record = await r.keys.create("acme", budget=100.0)
    stage = IngestStage(AUTH_REQUIRED, INGEST.topics, r.gateway)
    await run_handler(stage, request("x", api_key=raw))
    other = request("x", api_key=raw, deadline_s=5, messages=(ChatMessage(role="user", content="other"),))
    assert await refusal(stage, other) == (ErrorCode.invalid_request, "acme")
    r.clock.now += 120
    await r.gateway.finish(Done(id="acme/x", reply_to="x", chunks=1, digest="", finish_reason=FinishReason.stop, tenant="acme",
                                model=SETTINGS.models[0], usage=Usage(prompt_tokens=10, completion_tokens=10), created_at=1.0))
    assert await r.limiter.spent(Scope("key", record.key_id)) == pytest.approx(2.0)


@pytest.mark.asyncio
async def test_a_refusal_before_authentication_names_no_tenant() -> None:
    stage, raw = await ingest_with_key()
    with pytest.raises(StageError) as refused:  # the runner ends it under the client's id and the tenant ""
        await run_handler(stage, request("wrong-key", api_key=raw[:-4] + "AAAA"))
    assert refused.value.code is ErrorCode.unauthorized
