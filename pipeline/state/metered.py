"""A StateStore that counts takeovers and fenced writes for the stage using it, so an operator sees
streams moving between workers (a kill, a rebalance, a paused worker replaced) and a replaced worker
being stopped by its fence, without the stages saying anything themselves (observability at the edge).

A takeover is a `take` that found another worker's name in the key's owner field; a `take` of a key
this worker already owned (a rebuild after its own reset) or of a new key is not one. A fenced write is
a `write(..., owner=...)` or `advance` the store refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline import metrics
from pipeline.state.store import OWNER, StateStore


class MeteredStore:
    def __init__(self, inner: StateStore, stage: str) -> None:
        self._inner = inner
        self._takeovers = metrics.STATE_TAKEOVERS.labels(stage)
        self._fenced = metrics.STATE_FENCED.labels(stage)

    async def read(self, key: str) -> dict[str, bytes]:
        return await self._inner.read(key)

    async def write(self, key: str, fields: Mapping[str, bytes], *, owner: str | None = None) -> bool:
        written = await self._inner.write(key, fields, owner=owner)
        if not written:
            self._fenced.inc()
        return written

    async def advance(
        self, key: str, field: str, position: int, fields: Mapping[str, bytes], *, owner: str,
        always: Mapping[str, bytes] | None = None,
    ) -> bool:
        written = await self._inner.advance(key, field, position, fields, owner=owner, always=always)
        if not written:
            self._fenced.inc()
        return written

    async def amend(self, key: str, fields: Mapping[str, bytes]) -> bool:
        return await self._inner.amend(key, fields)

    async def claim(self, key: str, field: str, value: bytes) -> bool:
        return await self._inner.claim(key, field, value)

    async def take(self, key: str, owner: str) -> dict[str, bytes]:
        before = await self._inner.take(key, owner)
        previous = before.get(OWNER)
        if previous is not None and previous != owner.encode():
            self._takeovers.inc()
        return before

    async def forget(self, key: str) -> None:
        await self._inner.forget(key)

    async def aclose(self) -> None:
        await self._inner.aclose()
