"""A stage's committed offsets are never read as "none" because its group's coordinator was busy.

OffsetFetch v2 and later can answer a whole request with one error (KIP-88): the group's coordinator is
still loading its offsets, has moved, or is not available, and the response then lists no partitions.
aiokafka 0.14 (`GroupCoordinator._do_fetch_commit_offsets`) reads only the per-partition errors, so it
takes such an answer for "this group has committed nothing" and the consumer starts from
`auto_offset_reset`, the beginning of the topic. The chaos suite caught it once (session 42): after the
broker had been stopped for 20 s, ingest, prefill, decode and emit each read some partitions of their
input again from offset 0, and every old request ingest saw again got a second terminal event
(`deadline_exceeded`). pykafka #958 and kafka-python #2428 are the same defect in other clients.

`install()` (pipeline.kafka calls it) makes the coordinator raise the error such a response carries.
aiokafka already treats those errors as retriable: it asks again after its backoff, and the consumer waits
for the answer before it fetches. A moved or unavailable coordinator is marked dead so that it is looked
up again, as aiokafka does when the same error comes per partition.
"""

from __future__ import annotations

from typing import Any

from aiokafka import errors
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.protocol.commit import OffsetFetchRequest

_MOVED = (errors.NotCoordinatorForGroupError, errors.GroupCoordinatorNotAvailableError)


def check(request: object, response: object) -> None:
    """Raises the error an OffsetFetch response carries for the whole request, if it carries one."""
    code = getattr(response, "error_code", 0) if isinstance(request, OffsetFetchRequest) else 0
    if code:
        raise errors.for_code(code)()


def install() -> None:
    send = GroupCoordinator._send_req
    if getattr(send, "checks_offset_fetch", False):
        return

    async def send_checked(self: GroupCoordinator, request: Any) -> Any:
        response = await send(self, request)
        try:
            check(request, response)
        except _MOVED:
            self.coordinator_dead()
            raise
        return response

    send_checked.checks_offset_fetch = True  # type: ignore[attr-defined]
    GroupCoordinator._send_req = send_checked  # type: ignore[method-assign]
