"""A group's committed offsets are not taken for "none" when OffsetFetch fails as a whole (pipeline.offset_fetch)."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import errors
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.protocol.commit import OffsetFetchRequest, OffsetFetchResponse_v1, OffsetFetchResponse_v3
from aiokafka.structs import TopicPartition

from pipeline import kafka  # noqa: F401  (installs the check, as every process that makes a consumer does)
from pipeline.offset_fetch import check

TP = TopicPartition("llm.requests", 0)


class Client:
    def __init__(self, response: object) -> None:
        self.response = response

    async def send(self, node_id: int, request: object, **_: Any) -> object:
        return self.response


def coordinator(response: object) -> Any:
    """A GroupCoordinator with only what fetching committed offsets touches (no broker, no tasks)."""
    c: Any = object.__new__(GroupCoordinator)
    c.group_id, c.coordinator_id, c._client, c.dead = "ingest", 1, Client(response), 0

    def coordinator_dead(*_: object) -> None:
        c.dead += 1

    c.coordinator_dead = coordinator_dead
    return c


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("code", "error", "moved"),
    [(14, errors.GroupLoadInProgressError, False), (16, errors.NotCoordinatorForGroupError, True),
     (15, errors.GroupCoordinatorNotAvailableError, True)],
)
async def test_an_error_for_the_whole_request_is_raised_not_read_as_no_offsets(code: int, error: type, moved: bool) -> None:
    # Without the check aiokafka returned {} here, and the consumer started the partition from offset 0.
    c = coordinator(OffsetFetchResponse_v3(0, [], code))
    with pytest.raises(error) as raised:
        await c._do_fetch_commit_offsets([TP])
    assert raised.value.retriable  # aiokafka asks again after its backoff
    assert c.dead == (1 if moved else 0)


@pytest.mark.asyncio
async def test_committed_offsets_are_read_as_before() -> None:
    c = coordinator(OffsetFetchResponse_v3(0, [("llm.requests", [(0, 374, "", 0), (1, -1, "", 0)])], 0))
    offsets = await c._do_fetch_commit_offsets([TP, TopicPartition("llm.requests", 1)])
    assert {tp: o.offset for tp, o in offsets.items()} == {TP: 374}  # -1: nothing committed there, truly
    assert c.dead == 0


def test_only_offset_fetch_responses_with_a_top_level_error_raise() -> None:
    request = OffsetFetchRequest("ingest", [("llm.requests", [0])])
    check(request, OffsetFetchResponse_v3(0, [], 0))
    check(request, OffsetFetchResponse_v1([("llm.requests", [(0, 5, "", 0)])]))  # v1 has no top-level error
    check(object(), OffsetFetchResponse_v3(0, [], 14))  # not an OffsetFetch request
    with pytest.raises(errors.GroupAuthorizationFailedError):  # not retriable: the consumer fails loudly
        check(request, OffsetFetchResponse_v3(0, [], 30))
