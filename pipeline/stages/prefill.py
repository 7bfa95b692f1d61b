"""prefill: the context phase, for one pool. Computes the prompt, sends the first token at once (time to
first token) as chunk 0, and hands decode the KV state by handle (a backend with a KV store leaves it
there, for a decode worker in another process, before the handle goes on). A retriable backend failure (before
any token) sends the request on to the route's next fallback backend; it reports its backend's load,
failures and time to first token on `llm.backend.health`.

It hears `llm.control` too: a cancelled request's prefill stops within a step (a long prompt is fed
over many steps, and a cancelled backfill's lines would otherwise keep the engine busy for up to a
minute), and a request whose cancellation arrived first is not prefilled at all; either way its
terminal event (`cancelled`, or the code of the cancel's reason) leaves from here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from pipeline.backends.base import KVHandoff, SplitBackend
from pipeline.backends.errors import BackendError, Cancelled
from pipeline.errors import StageError
from pipeline.routing.reroute import rerouted
from pipeline.routing.stats import BackendStats
from pipeline.settings import BackendSettings
from pipeline.stage import Out, Stopwatch, address_of
from pipeline.stages.generation import CANCEL_CODE, Cancellations, generation_request, to_wire
from pipeline.topology import Topics
from topics import registry
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode
from topics.hops import Prefilled, Routed, client_id_of, forward
from topics.stream import EMPTY_DIGEST, FinishReason, Usage, digest_step


class PrefillStage:
    input_type = Routed
    ordered = False

    def __init__(
        self, backend: SplitBackend, topics: Topics, name: str = "prefill", worker: str = "0",
        stats: BackendStats | None = None, backends: Mapping[str, BackendSettings] | None = None,
    ) -> None:
        self.name, self.topics = name, topics
        self._backend = backend
        self._worker = worker
        self.stats = stats  # what this worker reports of its backend on llm.backend.health
        self._backends = backends or {}
        self._cancelled = Cancellations()
        self._running: set[str] = set()  # request ids whose prefill is in the backend

    async def on_control(self, message: Cancel) -> None:
        """Every prefill worker hears every cancellation: it stops the prefill if it runs it, and
        remembers it for a request still on its way."""
        self._cancelled.heard(message)
        for rid in [r for r in self._running if message.id in (r, client_id_of(r))]:
            await self._backend.cancel(rid)  # its prefill ends with `Cancelled`

    def report(self) -> list[Out]:
        return [Out(registry.HEALTH, self.stats.key, self.stats.report())] if self.stats is not None else []

    async def handle(self, message: Routed) -> AsyncIterator[Out]:
        clock = Stopwatch()
        address = address_of(message)
        assert address is not None
        stream = self.topics.stream or ""
        if (reason := self._cancelled.reason(message.id)) is not None:
            yield Out(stream, message.id, address.failed(CANCEL_CODE[reason], "cancelled before prefill started",
                                                         timings={**message.timings, self.name: clock.ms()}))
            return
        if self.stats is not None:
            self.stats.started()
        self._running.add(message.id)
        try:
            prefilled = await self._backend.prefill(generation_request(message.request, message.id))
        except asyncio.CancelledError:
            if self.stats is not None:
                self.stats.abandoned()
            raise
        except Cancelled:
            if self.stats is not None:
                self.stats.abandoned()
            reason = self._cancelled.reason(message.id) or CancelReason.client_gone
            yield Out(stream, message.id, address.failed(CANCEL_CODE[reason], "cancelled during prefill",
                                                         timings={**message.timings, self.name: clock.ms()}))
            return
        except BackendError as exc:
            if self.stats is not None and self.stats.finished(failed=exc.retriable):
                yield Out(registry.HEALTH, self.stats.key, self.stats.report())
            if exc.retriable and (onward := rerouted(message, self._backends)) is not None:
                yield onward  # failed before the first token: the route's next backend tries
                return
            text = f"prefill failed: {exc}" if exc.code is ErrorCode.invalid_request else f"backend failed during prefill ({type(exc).__name__})"
            raise StageError(exc.code, text) from exc
        finally:
            self._running.discard(message.id)
        if self.stats is not None:
            self.stats.first_token(clock.ms())
            self.stats.finished(failed=False)
        if prefilled.first_text:
            ends = prefilled.finish_reason is not None  # its Done follows at once, in the same batch
            yield Out(stream, message.id, address.chunk(0, prefilled.first_text, (prefilled.first_token_id,)), with_next=ends)
        if prefilled.finish_reason is None and isinstance(self._backend, KVHandoff):
            await self._backend.hand_off(prefilled)  # after the first token went: it costs no time to first token
        timings = {**message.timings, self.name: clock.ms()}
        if prefilled.finish_reason is not None:  # the first token already ended it
            sent = bool(prefilled.first_text)
            done = address.done(
                chunks=int(sent), digest=digest_step(EMPTY_DIGEST, prefilled.first_text) if sent else EMPTY_DIGEST,
                finish=FinishReason(prefilled.finish_reason), usage=Usage(prefilled.prompt_tokens, 1), timings=timings,
            )
            yield Out(stream, message.id, done)
            return
        handed = forward(message, Prefilled, prefill=to_wire(prefilled, self._worker), timings=timings)
        # Decode's chunks 1.. go to the stream topic once it reads this: sent after chunk 0 is acknowledged,
        # so chunk 0 is on the topic first. Sent at once, chunk 0's produce, retried across a broker restart,
        # landed after decode's chunk 1, and postguard took that for a stream whose state it had lost
        # (a fresh-clone CI run's output-guard chaos profile, session 39).
        yield Out(self.topics.forward or "", message.id, handed, after_acks=True)
