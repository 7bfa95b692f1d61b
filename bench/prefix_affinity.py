"""Prefix affinity against random choice and plain power of two choices: a simulation that runs route's
own choice function (`pipeline.routing.choose`) over a modelled cluster.

    .venv/bin/python -m bench.prefix_affinity [--requests 5000] [--members 3] [--seeds 5]

The cluster: `--members` backends, each with a prefix cache of `--cache-blocks` blocks of 16 tokens
(LRU, like the engine's hash-chained block cache: a block is reused only if every block before it is
too). Requests arrive one per tick and each holds its backend for `--service` ticks (that is the load
route sees). 80% of requests start with a shared 1,000-token prefix (a long system prompt; one of
`--prefixes` of them), then 200 tokens of their own; 20% are 1,200 tokens of their own. Prefilled tokens are the prompt tokens not
found in the chosen backend's cache. What is modelled, not measured: the engine's real cache and
timings (docs/benchmarks.md says so); what is exercised is the routing code as it runs in route.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import OrderedDict, deque

from pipeline.routing.choose import choose
from pipeline.routing.config import RoutingSettings
from pipeline.routing.health import Member

BLOCK = 16
CHARS_PER_TOKEN = 4


class Backend:
    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.capacity = capacity
        self.busy: deque[int] = deque()  # tick at which each running request ends
        self.served = 0

    def prefill(self, tokens: list[int]) -> int:
        """Prompt tokens computed (not found in the cache); the prompt's blocks are cached after."""
        hit = 0
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            key = tuple(tokens[:end])
            if key in self.blocks:
                self.blocks.move_to_end(key)
                hit = end
            else:
                break
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            self.blocks[tuple(tokens[:end])] = None
            self.blocks.move_to_end(tuple(tokens[:end]))
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return len(tokens) - hit


def workload(n: int, prefixes: int, rng: random.Random) -> list[list[int]]:
    shared = [[rng.randrange(50_000) for _ in range(1000)] for _ in range(prefixes)]
    own = lambda k: [rng.randrange(50_000) for _ in range(k)]  # noqa: E731
    return [(rng.choice(shared) if rng.random() < 0.8 else own(1000)) + own(200) for _ in range(n)]


def text_of(tokens: list[int]) -> str:
    return "".join(chr(0x4E00 + t % 20_000) * CHARS_PER_TOKEN for t in tokens[:300])  # what the affinity hash reads


def run(policy: str, prompts: list[list[int]], args: argparse.Namespace, seed: int) -> tuple[int, float]:
    rng = random.Random(seed)
    names = [f"b{i}" for i in range(args.members)]
    backends = {n: Backend(args.cache_blocks) for n in names}
    settings = RoutingSettings() if policy == "affinity" else RoutingSettings(affinity_chars=0)
    prefilled, loads = 0, {n: 0 for n in names}
    for tick, tokens in enumerate(prompts):
        for b in backends.values():
            while b.busy and b.busy[0] <= tick:
                b.busy.popleft()
        members = {n: Member(len(b.busy) / args.service, False, 0.0, True, 1.0 / args.service) for n, b in backends.items()}
        if policy == "random":
            chosen = rng.choice(names)
        else:
            chosen = choose(names, members, text_of(tokens), settings, rng=rng)[0]
        backend = backends[chosen]
        prefilled += backend.prefill(tokens)
        backend.busy.append(tick + args.service)
        backend.served += 1
        loads[chosen] += 1
    mean = statistics.fmean(loads.values())
    return prefilled, max(loads.values()) / mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--cache-blocks", type=int, default=400, help="per backend (400 blocks: 6,400 tokens)")
    parser.add_argument("--service", type=int, default=6, help="ticks a request holds its backend")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--prefixes", type=int, default=1, help="distinct 1,000-token prefixes the 80%% share")
    args = parser.parse_args()
    results: dict[str, list[tuple[int, float]]] = {p: [] for p in ("random", "p2c", "affinity")}
    for seed in range(args.seeds):  # interleaved: every policy on the same prompts, seed after seed
        prompts = workload(args.requests, args.prefixes, random.Random(1000 + seed))
        for policy in results:
            results[policy].append(run(policy, prompts, args, seed))
    base = statistics.fmean(p for p, _ in results["random"])
    print(f"\n{args.requests} requests x {args.seeds} seeds, {args.members} backends, cache {args.cache_blocks} blocks each, "
          f"{args.prefixes} shared prefix(es)\n")
    print("| policy | prefilled tokens (mean) | vs random | max/mean requests per backend (worst seed) |\n| --- | ---: | ---: | ---: |")
    for policy, rows in results.items():
        mean = statistics.fmean(p for p, _ in rows)
        print(f"| {policy} | {mean:,.0f} | {100 * (mean / base - 1):+.1f}% | {max(r for _, r in rows):.2f} |")


if __name__ == "__main__":
    main()
