"""Cost per request, end to end: the terminal event the client gets and the usage record carry the
request's tokens and their cost at the configured prices, and `sluice usage` reports them from llm.usage."""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid

import pytest

from pipeline.observability import costs, usage_cli
from pipeline.sdk import Client
from pipeline.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_done_and_usage_record_carry_the_cost(stack: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    async with Client(stack) as client:
        answer = await client.complete(messages=[{"role": "user", "content": f"Say yes. ({uuid.uuid4().hex[:6]})"}],
                                       max_tokens=4, no_cache=True)
    done = answer.done
    assert done.usage.prompt_tokens > 0 and done.usage.completion_tokens > 0
    assert done.cost == pytest.approx(costs.cost(stack.gateway.prices, done.model, done.usage)) and done.cost > 0
    tenant = done.id.split("/", 1)[0]
    for _ in range(50):  # the usage record follows the terminal event
        records = [r for r in await usage_cli.read_since(stack, done.created_at - 1) if r.id == done.id]
        if records:
            break
        await asyncio.sleep(0.2)
    [record] = records
    assert (record.prompt_tokens, record.completion_tokens, record.cost) == (done.usage.prompt_tokens, done.usage.completion_tokens, done.cost)
    capsys.readouterr()
    assert await usage_cli.run(stack, argparse.Namespace(tenant=tenant, since=600.0, json=True)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] >= 1 and report["cost"] >= done.cost
    assert report["models"][done.model]["outcomes"]["done"] >= 1  # usage records name "done" or the error code
    assert await usage_cli.run(stack, argparse.Namespace(tenant=tenant, since=600.0, json=False)) == 0
    assert "total" in capsys.readouterr().out
