"""generate: the one generation stage of a pool whose backend cannot split prefill from decode (Triton,
an OpenAI-compatible server). Reads `llm.routed.<pool>`, writes the stream, with decode's guarantees:
ownership in the state store, progress recorded after each acknowledged chunk, at most `AHEAD` chunks
unacknowledged, cancellation within a step, one terminal event recorded once sent.

Resume: such a backend cannot be handed tokens to continue from, so a worker that takes a stream over
asks for the answer again and drops the characters already delivered (`Progress.sent_chars`), then goes
on numbering chunks where its predecessor stopped. With greedy or seeded sampling on the same backend
the client sees one seamless stream; otherwise the continuation is a valid answer that may not join
the delivered part exactly (docs/reliability.md). Token counts come from the backend's last delta when
it reports them (an upstream server's usage), else from the token ids it streamed, else (a backend that
streams text only, an upstream that sends no usage) they are estimated from characters (`_usage`). A
retriable failure before the first chunk sends the request on to the route's next fallback backend.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping

from pipeline.backends.base import Backend, Delta
from pipeline.gateway.estimate import prompt_estimate
from pipeline.routing.stats import BackendStats
from pipeline.settings import BackendSettings
from pipeline.stages.coalesce import STREAM_WINDOW_S
from pipeline.stages.decode import DecodeStage, Progress
from pipeline.stages.generation import generation_request
from pipeline.state import StateStore
from pipeline.topology import Topics
from topics.hops import Routed
from topics.stream import EMPTY_DIGEST, Usage

CHARS_PER_TOKEN = 4  # the gateway's default `chars_per_token`, which its admission estimate divides by


class GenerateStage(DecodeStage):
    input_type = Routed
    phase = "generation"
    reroutes = True  # a backend that fails before the first chunk: the request moves on to the next fallback

    def __init__(
        self, backend: Backend, topics: Topics, store: StateStore, name: str = "generate",
        stats: BackendStats | None = None, backends: Mapping[str, BackendSettings] | None = None,
        chunk_window_s: float = STREAM_WINDOW_S, chars_per_token: int = CHARS_PER_TOKEN,
    ) -> None:
        super().__init__(backend, topics, store, name=name, stats=stats, backends=backends,  # type: ignore[arg-type]
                         chunk_window_s=chunk_window_s)
        self._chars_per_token = chars_per_token  # for the usage estimate of a backend that reports none

    def _first(self, message: Routed) -> Progress:  # type: ignore[override]
        return Progress((), 0, 0, EMPTY_DIGEST)

    def _deltas(self, message: Routed, progress: Progress, resumed: bool) -> AsyncIterator[Delta]:  # type: ignore[override]
        stream = self._backend.generate(generation_request(message.request, message.id))
        return _after_chars(stream, progress.sent_chars) if resumed and progress.sent_chars else stream

    def _usage(self, message: Routed, progress: Progress, reported: Delta | None) -> Usage:  # type: ignore[override]
        """The backend's counts where its last delta has them. Else ESTIMATES: the prompt as the gateway
        estimates it at admission (`gateway.estimate.prompt_estimate`), and the completion's token ids,
        or for a backend that streams text only its characters sent / `chars_per_token` (never 0 for
        text). A request the backend gave nothing for (no text, no ending) is billed nothing."""
        prompt = reported.prompt_tokens if reported is not None else None
        completion = reported.completion_tokens if reported is not None else None
        if not (progress.sent_chars or progress.tokens or (reported is not None and reported.finish_reason is not None)):
            return Usage(prompt or 0, completion or 0)
        if prompt is None:
            request = message.request
            prompt = prompt_estimate(request, self._chars_per_token)
        if completion is None:
            completion = len(progress.tokens) or self._estimate(progress.sent_chars)
        return Usage(prompt, completion)

    def _estimate(self, chars: int) -> int:
        return math.ceil(chars / self._chars_per_token)


async def _after_chars(stream: AsyncIterator[Delta], skip: int) -> AsyncIterator[Delta]:
    """`stream` without its first `skip` characters (what a predecessor already delivered); the token ids
    of the dropped text are dropped too (the stored progress counts them)."""
    try:
        async for delta in stream:
            if skip >= len(delta.text) and delta.finish_reason is None:
                skip -= len(delta.text)
                continue
            if skip:
                delta = Delta(delta.text[skip:], (), delta.finish_reason, delta.prompt_tokens, delta.completion_tokens)
                skip = 0
            yield delta
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
