"""The guard's memory of pieces it has already judged, so that a text it has seen is not screened again.

A chat sends its whole history with every turn, so the system prompt and earlier turns reach the guard
again and again, and a repeated question (a cache hit) is screened in full before the cache can answer.
A piece's verdict (PII findings as entity and offsets, and the injection probability) depends only on its
text and which checks it needs, not on the tenant: the tenant's policy and threshold are applied to the
verdicts afterwards (`GuardStage.sanitise`). The key still names the tenant: a memo shared between tenants
would answer faster for a text another tenant sent, and the time would tell a caller what others ask.
So the memo is keyed by a digest of the tenant, the text and the checks, holds no text, lives in the
guard process only, and forgets the least recently used entries past its size (`guard.verdict_memo`).
Lookups are counted in `sluice_guard_verdict_memo_total{result="hit"|"miss"}`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from pipeline.guard.slices import Piece, PieceVerdict
from pipeline.metrics import GUARD_MEMO


def _key(tenant: str, piece: Piece) -> bytes:
    name = tenant.encode()
    digest = hashlib.blake2b(len(name).to_bytes(4, "little") + name + piece.text.encode(), digest_size=16)
    return digest.digest() + bytes((piece.pii, piece.injection)) + piece.offset.to_bytes(8, "little")


class VerdictMemo:
    def __init__(self, size: int) -> None:
        self.size = size  # 0: remembers nothing
        self._verdicts: OrderedDict[bytes, PieceVerdict] = OrderedDict()

    def get(self, tenant: str, piece: Piece) -> PieceVerdict | None:
        if not self.size:
            return None
        verdict = self._verdicts.get(key := _key(tenant, piece))
        if verdict is not None:
            self._verdicts.move_to_end(key)
        GUARD_MEMO.labels("miss" if verdict is None else "hit").inc()
        return verdict

    def put(self, tenant: str, piece: Piece, verdict: PieceVerdict) -> None:
        if not self.size:
            return
        key = _key(tenant, piece)
        self._verdicts[key] = verdict
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > self.size:
            self._verdicts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._verdicts)
