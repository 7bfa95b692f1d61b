"""ingest: the front door. Validates a request against the operator's limits, asks the gateway who sent
it and whether it may (authentication, model, reply topic, network rules, rate limits, budgets), and
passes it on under the authenticated tenant, without its credential.

The id every later stage keys on is minted here: `<tenant>/<client id>` (topics.hops.request_key). The
same client id sent again with other content is refused while the first is remembered (the state
store's TTL); sent again byte for byte it is a redelivery, and the stages after ingest are idempotent
per id (a finished request is not generated again).

A refusal is the request's terminal event under the client's own id (the runner sends it); one made after
authentication (a limit, a budget, a model the key may not use, an id in use) names the authenticated
tenant (`StageError.tenant`), so its usage record counts under that tenant (`sluice usage --tenant`). Not
the pipeline's id `<tenant>/<id>`: an id in use names a request that runs or ended, which a refusal must
not end, nor be dropped as a repeat of.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

from pipeline.errors import StageError, Undeliverable
from pipeline.gateway.build import memory_gateway
from pipeline.gateway.gateway import Gateway, Principal
from pipeline.settings import Settings
from pipeline.stage import Out, Stopwatch
from pipeline.state import MemoryStateStore, StateStore
from pipeline.topology import Topics
from topics import codec
from topics.errors import ErrorCode
from topics.hops import Admitted, request_key
from topics.requests import Request

MAX_STOP = 4  # stop sequences a request may carry (OpenAI's own limit)
MAX_STOP_BYTES = 256  # the longest one
MAX_CLOCK_SKEW_S = 300.0  # how far in the future a request's created_at may be (another host's clock)
DEADLINE_SLACK_S = 5.0  # how far past now + max_deadline_s a request's deadline may be (see `check`)


class IngestStage:
    input_type = Request
    ordered = False

    def __init__(
        self, settings: Settings, topics: Topics, gateway: Gateway | None = None, store: StateStore | None = None,
        name: str = "ingest",
    ) -> None:
        """`gateway` and `store` hold shared state (Redis in production); None: in memory, for tests."""
        self.name, self.topics = name, topics
        self._gateway = gateway or memory_gateway(settings)
        self._store = store if store is not None else MemoryStateStore()
        self._limits = settings.limits
        self._models = frozenset(settings.models)
        self._replies = settings.reply_topics
        self._auth_first = settings.gateway.auth_required

    async def aclose(self) -> None:
        await self._gateway.aclose()
        await self._store.aclose()

    def check(self, request: Request) -> None:
        """Raises StageError with a reason the client can act on; returns if the request is admissible."""
        if request.reply_to not in self._replies:
            raise Undeliverable("reply_to is not a configured reply topic")
        limits = self._limits
        if (request.prompt is None) == (not request.messages):
            raise StageError(ErrorCode.invalid_request, "exactly one of `messages` and `prompt` must be given")
        if request.prompt == "":  # as the bridge: else a backend refused it (local, instant) or sent it to the model
            raise StageError(ErrorCode.invalid_request, "`prompt` must be a non-empty string")
        if len(request.messages) > limits.max_messages:
            raise StageError(ErrorCode.invalid_request, f"at most {limits.max_messages} messages are allowed")
        stops = request.sampling.stop  # checked on every token generated: a few short ones (the bridge's bound too)
        if len(stops) > MAX_STOP or not all(0 < len(s.encode()) <= MAX_STOP_BYTES for s in stops):
            raise StageError(ErrorCode.invalid_request, f"at most {MAX_STOP} stop sequences of 1-{MAX_STOP_BYTES} bytes each")
        size = sum(len(m.content.encode()) for m in request.messages) + len((request.prompt or "").encode())
        if size > limits.max_prompt_bytes:
            raise StageError(ErrorCode.invalid_request, f"prompt is {size} bytes; the limit is {limits.max_prompt_bytes}")
        if not request.deadline_s <= limits.max_deadline_s:
            raise StageError(ErrorCode.invalid_request, f"deadline_s may be at most {limits.max_deadline_s:g}")
        now = time.time()
        if not 0 < request.created_at <= now + MAX_CLOCK_SKEW_S:  # 0 made the deadline move with the clock
            raise StageError(ErrorCode.invalid_request, "created_at must be the request's time of creation (unix seconds)")
        # Every stage keeps a request's state (its id's claim included) for state.ttl_s from about now, and
        # settings hold that to at least max_deadline_s: a deadline further away (created_at ahead of this
        # clock) let the id be used again while its request still ran, a second terminal event. A few
        # seconds over are let through (DEADLINE_SLACK_S): a sender whose clock runs a little ahead (NTP
        # keeps hosts within milliseconds) with deadline_s at the maximum, as a batch line may have, was
        # refused for good; the claim may then end those seconds before the deadline, not more.
        if request.created_at + request.deadline_s > now + limits.max_deadline_s + DEADLINE_SLACK_S:
            raise StageError(ErrorCode.invalid_request, (
                f"the request's deadline (created_at + deadline_s) may be at most {limits.max_deadline_s:g} s from "
                f"now; created_at is {request.created_at - now:.3f} s ahead of this clock"))
        if request.sampling.max_tokens > limits.max_tokens_cap:
            raise StageError(ErrorCode.invalid_request, f"max_tokens may be at most {limits.max_tokens_cap}")
        if request.model not in self._models:
            raise StageError(ErrorCode.not_found, f"unknown model; available: {', '.join(sorted(self._models))}")

    async def handle(self, message: Request) -> AsyncIterator[Out]:
        clock = Stopwatch()
        now = time.time()
        if message.reply_to not in self._replies:  # first of all: a refusal is only ever sent to a configured topic
            raise Undeliverable("reply_to is not a configured reply topic")
        if not self._auth_first:
            self.check(message)
        principal = await self._gateway.authenticate(message)  # a refusal up to here names no tenant
        try:
            admitted = await self._admit(message, principal, now, clock)
        except StageError as exc:
            exc.tenant = principal.tenant  # the terminal event names who was refused: usage counts it under them
            raise
        yield Out(self.topics.forward or "", admitted.id, admitted)

    async def _admit(self, message: Request, principal: Principal, now: float, clock: Stopwatch) -> Admitted:
        """`message` under its authenticated tenant, or StageError if it may not pass."""
        if self._auth_first:  # where auth is required, a caller proves who it is before validation tells it anything
            self.check(message)
        rid = request_key(principal.tenant, message.id)
        fingerprint = hashlib.sha256(codec.encode(message)).hexdigest()[:32].encode()
        # A request past its deadline is refused unless this very request was claimed before: then it is
        # a copy of one ingest passed on already (its group sent back to an old offset), whose ending the
        # stages after it know, and a refusal now would be a second terminal event. One refused by its
        # deadline was never claimed, so a copy of it is refused again, and emit drops the repeat.
        if now > message.created_at + message.deadline_s and (await self._store.read(rid)).get("fingerprint") != fingerprint:
            raise StageError(ErrorCode.deadline_exceeded, "the request's deadline passed before it was admitted")
        # The id's claim and the rate limits are independent round trips: made at once, one waits for the
        # other instead of after it. A refused request may leave its id claimed, which only refuses that id
        # sent again with other content (ids are single-use; the same bytes again pass as a redelivery).
        claim = asyncio.ensure_future(self._store.claim(rid, "fingerprint", fingerprint))
        try:
            request, principal = await self._gateway.admit(message, principal)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # revoked work stops now, not after Redis answers
                claim.cancel()
            await asyncio.gather(claim, return_exceptions=True)  # a refusal is what the client hears
            raise
        if not await claim:
            if (await self._store.read(rid)).get("fingerprint") != fingerprint:
                raise StageError(ErrorCode.invalid_request, "this request id is already in use; send a new id")
        return Admitted(
            id=rid, request=request, tenant=principal.tenant, principal=principal.name, admitted_at=now,
            timings={self.name: clock.ms()},
        )
