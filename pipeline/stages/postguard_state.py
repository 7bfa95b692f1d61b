"""postguard's per-request state as it is stored, so a successor continues a stream its predecessor
was holding back (`StateStore` field "postguard").

`Window` is written before the outputs of each input chunk are produced (write-ahead), together with
every released chunk whose acknowledgement has not been seen yet: a successor that restores it sends
those again (emit drops what the client already has) and goes on from the next input chunk.

What is stored of the text: the held-back chunks (the newest `guard.holdback_tokens` of the model's
output, or a few hundred characters while an entity-shaped run is held: stream_check.py; not yet
checked, so not yet redacted), the released chunks not yet acknowledged (redacted), and
the input chunks that arrived ahead of a gap (not yet checked: their messages are finished, so only the
window keeps them).
Released text is not kept (the open sentence's context restarts empty after a takeover: the checks of
that one sentence see only its unreleased part), and the placeholder table holds digests of values,
never the values (`Placeholders.known`). The key expires with the request's state (`state.ttl_s`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import msgspec

from pipeline.guard.entities import Action
from pipeline.guard.errors import Reason
from pipeline.guard.redact import Placeholders
from pipeline.guard.stream_check import StreamState

FIELD = "postguard"
# the terminal event, encoded without its cache ticket: sent again (after the window's unacknowledged chunks) on a redelivery
ENDED = "postguard_end"


class Window(msgspec.Struct, frozen=True):
    next_in: int  # the input seq expected next
    next_out: int  # the seq of the next released chunk
    digest: str  # hash chain of the released texts
    pending: str  # held-back text
    lengths: list[int]  # characters of each held chunk
    placeholders: dict[str, str]  # value digest -> placeholder
    unacked: dict[int, str]  # released chunks not yet acknowledged: seq -> text
    killed: Reason | None = None
    held: dict[int, str] = {}  # input chunks that arrived early, held until the gap before them fills: seq -> text
    received: str = ""  # hash chain of the input texts taken in order ("": a window written before it was kept)


_decoder = msgspec.msgpack.Decoder(Window)


def encode(window: Window) -> bytes:
    return msgspec.msgpack.encode(window)


def decode(raw: bytes) -> Window:
    return _decoder.decode(raw)


def window_of(
    check: StreamState, *, next_in: int, next_out: int, digest: str, unacked: dict[int, str], killed: Reason | None,
    held: dict[int, str], received: str,
) -> Window:
    return Window(next_in, next_out, digest, check.pending, list(check.lengths), check.placeholders.known(),
                  dict(unacked), killed, held, received)


def restore_check(window: Window, policy: Mapping[str, Action]) -> StreamState:
    """The output checks' state as the window left it (sentence scores are recomputed when needed)."""
    return StreamState(policy, window.pending, deque(window.lengths), "", Placeholders(window.placeholders))
