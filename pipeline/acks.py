"""The broker's acknowledgements of what a stage sends (`pipeline.handling`): futures chained so that an
output's `acked` runs in order, waited for together, or already done for a message handed over in memory."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.stage import Out
from topics.stream import Done, Failed


async def after(ack: asyncio.Future[Any], acked: Callable[[], Awaitable[None]], previous: asyncio.Task[None] | None) -> None:
    """Runs `acked` once `ack` is in and the `acked` of the output before it has run: in send order."""
    if previous is not None:
        await previous
    await ack
    await acked()


async def all_of(acks: list[asyncio.Future[Any]]) -> None:
    """`asyncio.gather(*acks)`, without its trip through the event loop when every acknowledgement is in
    already (all handed over in memory, or acknowledged while the stage worked): raises the first error."""
    if all(ack.done() for ack in acks):
        for ack in acks:
            ack.result()
        return
    await asyncio.gather(*acks)


def acknowledged() -> asyncio.Future[Any]:
    """What a taker returns for a message it handled in memory: an acknowledgement that is already done."""
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


def on_delivery(ack: asyncio.Future[Any], out: Out) -> None:
    """Calls `out.delivered` once the broker acknowledged `out` (whatever the `acked` before it did),
    `out.refused` once it failed to."""
    delivered, refused = out.delivered, out.refused
    if delivered is None and refused is None:
        return

    def outcome(ack: asyncio.Future[Any]) -> None:
        if not ack.cancelled() and ack.exception() is None:
            if delivered is not None:
                delivered()
        elif refused is not None:
            refused()

    ack.add_done_callback(outcome)


def quiet(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def waits(out: Out) -> bool:
    """Whether `out` goes only once the outputs before it are acknowledged (see `Handling._send_all`)."""
    return out.after_acks or isinstance(out.value, Done | Failed)
