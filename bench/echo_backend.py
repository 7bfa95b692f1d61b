"""A measuring instrument, not a product backend: answers at once with fixed words, so that a benchmark
through it measures the pipeline alone (Kafka hops, codecs, stage handlers) and not a model."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pipeline.backends.base import Delta, GenerationRequest, Prefilled

WORDS = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")


class EchoBackend:
    name = "echo"

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return sum(len(m.content.split()) for m in request.messages) + len((request.prompt or "").split())

    async def prefill(self, request: GenerationRequest) -> Prefilled:
        done = "length" if request.max_tokens == 1 else None
        return Prefilled("echo", 0, WORDS[0], self.count_prompt_tokens(request), done)

    async def decode(self, request: GenerationRequest, prefilled: Prefilled) -> AsyncIterator[Delta]:
        n = min(request.max_tokens, len(WORDS))
        for i in range(1, n):
            yield Delta(WORDS[i], (i,), ("length" if n == request.max_tokens else "stop") if i == n - 1 else None)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        first = await self.prefill(request)
        yield Delta(first.first_text, (0,), first.finish_reason)
        async for delta in self.decode(request, first):
            yield delta

    async def cancel(self, request_id: str) -> None:
        return None

    async def aclose(self) -> None:
        return None
