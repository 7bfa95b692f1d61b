"""`sluice usage --tenant T --since 1h`: a tenant's requests, tokens and spend, read from `llm.usage`.

`llm.usage` (keyed by tenant, kept 30 days) holds one record per finished request with its tokens and
cost at the configured prices (emit writes it once per request). The command seeks every partition to
the first record at or after `--since` (Kafka's time index), reads to the end as it was when the command
started, and sums what matches. Nothing is stored elsewhere: billing systems read the same topic.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline import kafka
from pipeline.settings import Settings
from topics import codec, registry
from topics.usage import UsageRecord

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


MAX_SINCE_S = 3650 * 86400.0  # ten years: far past the topic's retention, short of the epoch


def duration(text: str) -> float:
    """'90s', '15m', '1h', '7d' (or a bare number of seconds) in seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 90s, 15m, 1h, 7d)")
    seconds = float(match.group(1)) * UNITS[match.group(2) or "s"]
    if not seconds <= MAX_SINCE_S:  # past it, the time index is asked for a time before 1970 (or infinity)
        raise argparse.ArgumentTypeError(f"at most {MAX_SINCE_S // 86400:.0f}d: llm.usage keeps 30 days")
    return seconds


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    usage = sub.add_parser("usage", help="a tenant's requests, tokens and spend from llm.usage")
    usage.add_argument("--tenant", required=True, help="the tenant (as ingest authenticated it)")
    usage.add_argument("--since", type=duration, default=3600.0, help="how far back: 90s, 15m, 1h, 7d (default 1h)")
    usage.add_argument("--json", action="store_true", help="one JSON object instead of a table")


@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, record: UsageRecord) -> None:
        self.requests += 1
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens
        self.cost += record.cost
        self.outcomes[record.outcome] += 1


def summarise(records: Iterable[UsageRecord], tenant: str, since: float) -> dict[str, Tally]:
    """Per model, the records of `tenant` at or after `since` (unix seconds)."""
    by_model: dict[str, Tally] = defaultdict(Tally)
    for record in records:
        if record.tenant == tenant and record.at >= since:
            by_model[record.model].add(record)
    return dict(by_model)


async def read_since(settings: Settings, since: float) -> list[UsageRecord]:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap, client_id="sluice-usage", group_id=None,
                                enable_auto_commit=False, **kafka.security(settings))
    await consumer.start()
    try:
        [spec] = [spec for spec in kafka.topic_specs(settings) if spec.name == registry.USAGE]
        tps = [TopicPartition(registry.USAGE, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        starts = await consumer.offsets_for_times({tp: int(since * 1000) for tp in tps})
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            found = starts.get(tp)
            consumer.seek(tp, found.offset if found is not None else ends[tp])
        records: list[UsageRecord] = []
        remaining = {tp for tp in tps if (await consumer.position(tp)) < ends[tp]}
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=1000)
            for tp, items in batch.items():
                for item in items:
                    if item.offset < ends[tp]:
                        try:
                            records.append(codec.decode(item.value or b"", UsageRecord))
                        except codec.SchemaError:
                            continue  # not a usage record (emit is its only writer): skipped, not summed
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
        return records
    finally:
        await consumer.stop()


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (escape sequences, carriage returns, newlines)
    written as its Python escape: a record's model and outcome are data, and they cannot move the cursor
    or add a row to the table."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def render(tenant: str, since_s: float, by_model: dict[str, Tally]) -> str:
    tenant = printable(tenant)
    lines = [f"tenant {tenant}, last {since_s:g} s", f"{'model':<28}{'requests':>10}{'prompt':>10}{'completion':>12}{'cost':>12}  outcomes"]
    total = Tally()
    for model, tally in sorted(by_model.items()):
        outcomes = printable(", ".join(f"{k}={v}" for k, v in sorted(tally.outcomes.items())))
        lines.append(f"{printable(model):<28}{tally.requests:>10}{tally.prompt_tokens:>10}{tally.completion_tokens:>12}{tally.cost:>12.6f}  {outcomes}")
        total.requests += tally.requests
        total.prompt_tokens += tally.prompt_tokens
        total.completion_tokens += tally.completion_tokens
        total.cost += tally.cost
    lines.append(f"{'total':<28}{total.requests:>10}{total.prompt_tokens:>10}{total.completion_tokens:>12}{total.cost:>12.6f}")
    return "\n".join(lines)


async def run(settings: Settings, args: argparse.Namespace) -> int:
    since = time.time() - args.since
    by_model = summarise(await read_since(settings, since), args.tenant, since)
    if args.json:
        print(json.dumps({
            "tenant": args.tenant, "since": since,
            "models": {m: {"requests": t.requests, "prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens,
                           "cost": round(t.cost, 9), "outcomes": dict(t.outcomes)} for m, t in by_model.items()},
            "cost": round(sum(t.cost for t in by_model.values()), 9),
            "requests": sum(t.requests for t in by_model.values()),
        }))
    else:
        print(render(args.tenant, args.since, by_model))
    return 0
