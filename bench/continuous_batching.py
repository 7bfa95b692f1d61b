"""Continuous batching (the engine) against static batching done well, same model, same ShareGPT
prompts, the same forced output length per request in every system, greedy, token ids compared.

Systems (each request's length is its ShareGPT answer's token count clipped to [4, --max-output]; EOS
is ignored everywhere, so every system produces exactly those tokens):

- continuous: the engine (`LLMEngine`), every request queued at once; a slot is refilled the step a
  sequence ends (chunked prefill, paged KV).
- engine-static: the same engine and KV pool, fed a batch of B requests at a time and refilled only
  when the whole batch has finished (a finished row stops costing: it leaves the step).
- hf-generate: transformers `generate` on left-padded batches of B in arrival order, a per-row
  `StoppingCriteria` (each row stops at its own limit) and the better cache on DEV (dynamic or
  `cache_implementation="static"`). In transformers a stopped row stays in the batch until the batch
  ends, so the batch still costs max(limits) steps.
- hf-rowdrop: the same transformers model driven step by step over a `DynamicCache`, dropping a row
  from the batch and its cache (`batch_select_indices`) the step it reaches its limit: static batching
  where a finished row stops costing.

Equal memory: the engine's KV pool is what a static batcher reserves for its batch, B x (max_prompt +
max_output) tokens. Knobs (B per static system, the HF cache, the engine's max_num_seqs) are chosen
on a DEV split of the prompts (`--split dev` sweeps them) and reported on a separate TEST split
(`--split test`, systems interleaved A B C D, B C D A, ... `--repeats` times, median and min-max).

    .venv/bin/python -m bench.continuous_batching --split dev
    .venv/bin/python -m bench.continuous_batching --split test --repeats 3 --batch 8 --hf-cache dynamic --engine-batch 32
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from bench.engine_common import Workload, add_model_args, load_model, make_engine, peak_rss_mib, sharegpt_workload, sync
from pipeline.engine.config import EngineConfig, ModelConfig
from pipeline.engine.params import EngineRequest

PAD = 2
Outputs = list[list[int]]


@dataclass
class Run:
    outputs: Outputs
    seconds: float


def requests(workload: Workload, salt: str) -> list[EngineRequest]:
    """No stop tokens: each request runs to its max_tokens. A fresh salt per run, so no run reuses
    another's prefix-cache blocks (within a run the chat template's shared system prompt may hit)."""
    return [EngineRequest(p, max_tokens=m, salt=salt) for p, m in zip(workload.prompt_ids, workload.max_tokens, strict=True)]


def engine_continuous(engine, workload: Workload, salt: str) -> Run:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    seqs = [engine.add_request(r) for r in requests(workload, salt)]
    while engine.has_unfinished():
        engine.step()
    sync(engine.config.device)
    return Run([list(s.completion_ids) for s in seqs], time.perf_counter() - start)


def engine_static(engine, workload: Workload, batch: int, salt: str) -> Run:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    outputs: Outputs = []
    pending = requests(workload, salt)
    for i in range(0, len(pending), batch):
        seqs = [engine.add_request(r) for r in pending[i : i + batch]]
        while engine.has_unfinished():
            engine.step()
        outputs += [list(s.completion_ids) for s in seqs]
    sync(engine.config.device)
    return Run(outputs, time.perf_counter() - start)


def left_padded(prompts: list[tuple[int, ...]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


class RowLimits(StoppingCriteria):
    """Per-row stopping: row i is done once it has `limits[i]` new tokens."""

    def __init__(self, start: int, limits: list[int], device: str) -> None:
        self.start, self.limits = start, torch.tensor(limits, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
        return (input_ids.shape[1] - self.start) >= self.limits  # type: ignore[return-value]


def hf_generate(model, workload: Workload, batch: int, cache: str, device: str) -> Run:  # type: ignore[no-untyped-def]
    # transformers (4.50 on) fills an eos_token_id left unset from the model's own generation config, so
    # rows stopped at EOS and were padded where every other system runs to the forced length: unset it there
    model.generation_config.eos_token_id = None
    config = copy.deepcopy(model.generation_config)
    config.pad_token_id, config.do_sample = PAD, False
    config.temperature = config.top_p = config.top_k = None
    outputs: Outputs = []
    start = time.perf_counter()
    for i in range(0, len(workload.prompt_ids), batch):
        prompts, limits = workload.prompt_ids[i : i + batch], workload.max_tokens[i : i + batch]
        ids, mask = left_padded(prompts, device)
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, generation_config=config, max_new_tokens=max(limits),
                stopping_criteria=StoppingCriteriaList([RowLimits(ids.shape[1], limits, device)]), **extra,
            )
        outputs += [out[row, ids.shape[1] : ids.shape[1] + limit].tolist() for row, limit in enumerate(limits)]
    sync(device)
    return Run(outputs, time.perf_counter() - start)


def hf_rowdrop(model, workload: Workload, batch: int, device: str) -> Run:  # type: ignore[no-untyped-def]
    outputs: Outputs = []
    start = time.perf_counter()
    for i in range(0, len(workload.prompt_ids), batch):
        outputs += _rowdrop_batch(model, workload.prompt_ids[i : i + batch], workload.max_tokens[i : i + batch], device)
    sync(device)
    return Run(outputs, time.perf_counter() - start)


@torch.inference_mode()
def _rowdrop_batch(model, prompts: list[tuple[int, ...]], limits: list[int], device: str) -> Outputs:  # type: ignore[no-untyped-def]
    ids, mask = left_padded(prompts, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, logits_to_keep=1).logits
    live = list(range(len(prompts)))
    outputs: Outputs = [[] for _ in prompts]
    position = positions[:, -1:] + 1
    while True:
        token = logits[:, -1].argmax(-1)
        for j, row in enumerate(live):
            outputs[row].append(int(token[j]))
        keep = [j for j, row in enumerate(live) if len(outputs[row]) < limits[row]]
        if not keep:
            return outputs
        if len(keep) < len(live):  # rows that reached their limit leave the batch and its cache
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            token, mask, position, live = token[index], mask[index], position[index], [live[j] for j in keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position, past_key_values=cache).logits
        position = position + 1


def agreement(runs: Outputs, reference: Outputs) -> tuple[float, float]:
    """(fraction of requests with identical token ids, fraction of tokens before the first divergence)."""
    same = sum(a == b for a, b in zip(runs, reference, strict=True))
    prefix = 0
    for a, b in zip(runs, reference, strict=True):
        prefix += next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / len(reference), prefix / sum(map(len, reference))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--split", choices=["dev", "test"], default="test")
    parser.add_argument("--dev-requests", type=int, default=16)
    parser.add_argument("--test-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="static batch size B (engine-static, HF); sets the KV memory")
    parser.add_argument("--hf-batch", type=int, default=0, help="B for the transformers rows (default: --batch)")
    parser.add_argument("--hf-cache", choices=["dynamic", "static"], default="dynamic")
    parser.add_argument("--engine-batch", type=int, default=32, help="the engine's max_num_seqs in that KV memory")
    parser.add_argument("--sweep-batches", default="4,8,16", help="--split dev: static B values tried")
    parser.add_argument("--sweep-engine", default="8,16,32,64", help="--split dev: max_num_seqs values tried")
    parser.add_argument("--systems", default="", help="--split test: a comma-separated subset of continuous, "
                        "engine-static, hf-generate, hf-rowdrop (default: all)")
    parser.add_argument("--max-prompt", type=int, default=192)
    parser.add_argument("--max-output", type=int, default=256, help="clip ShareGPT answer lengths to this")
    args = parser.parse_args()
    model, tokenizer = load_model(args)
    both = sharegpt_workload(tokenizer, args.dev_requests + args.test_requests, args.max_prompt, args.max_output)
    cut = args.dev_requests
    dev = Workload(both.prompt_ids[:cut], both.max_tokens[:cut])
    test = Workload(both.prompt_ids[cut:], both.max_tokens[cut:])
    workload = dev if args.split == "dev" else test
    per_token = ModelConfig.from_dict(model.config.to_dict()).kv_bytes_per_token(getattr(torch, args.dtype).itemsize)

    def kv_bytes(batch: int) -> int:  # what a static batcher of `batch` reserves: every row at its worst case
        return batch * (args.max_prompt + args.max_output) * per_token

    def engine_for(max_num_seqs: int, batch: int):  # type: ignore[no-untyped-def]
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, device=args.device,
                              dtype=args.dtype, kv_cache_bytes=kv_bytes(batch))
        engine = make_engine(model, config)
        engine.generate([EngineRequest(workload.prompt_ids[0], max_tokens=2, salt="warm-up")])
        return engine

    warm = Workload(workload.prompt_ids[:2], [2, 2])
    hf_generate(model, warm, 2, "dynamic", args.device)
    hf_generate(model, warm, 2, "static", args.device)
    hf_rowdrop(model, warm, 2, args.device)
    print(f"model: {'random weights' if args.random_weights else 'SmolLM2-135M-Instruct'}; {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} torch threads; split {args.split}: {len(workload.prompt_ids)} ShareGPT prompts, "
          f"prompt tokens mean {statistics.fmean(map(len, workload.prompt_ids)):.0f}, output tokens mean "
          f"{statistics.fmean(workload.max_tokens):.0f} max {max(workload.max_tokens)} (clipped to [4, {args.max_output}]), "
          f"{sum(workload.max_tokens)} in all; load average at start {os.getloadavg()[0]:.2f}")
    if args.split == "dev":
        sweep(args, workload, model, engine_for, kv_bytes)
    else:
        compare(args, workload, model, engine_for, kv_bytes)
    print(f"peak RSS {peak_rss_mib():.0f} MiB; load average at end {os.getloadavg()[0]:.2f}")


def timed(label: str, run: Callable[[], Run], workload: Workload) -> Run:
    result = run()
    assert [len(o) for o in result.outputs] == workload.max_tokens, f"{label}: lengths differ from the limits"
    print(f"  {label}: {result.seconds:.1f} s, {sum(workload.max_tokens) / result.seconds:.2f} tokens/s "
          f"(load {os.getloadavg()[0]:.2f})", flush=True)
    return result


def sweep(args, workload, model, engine_for, kv_bytes) -> None:  # type: ignore[no-untyped-def]
    """One run per setting on DEV (knob choice only; the figures come from TEST)."""
    device = args.device
    for batch in map(int, args.sweep_batches.split(",")):
        engine = engine_for(batch, batch)
        timed(f"engine-static B={batch}", lambda: engine_static(engine, workload, batch, f"s{batch}"), workload)
        for cache in ("dynamic", "static"):
            timed(f"hf-generate B={batch} cache={cache}", lambda: hf_generate(model, workload, batch, cache, device), workload)
        timed(f"hf-rowdrop B={batch}", lambda: hf_rowdrop(model, workload, batch, device), workload)
    for seqs in map(int, args.sweep_engine.split(",")):
        engine = engine_for(seqs, args.batch)
        timed(f"continuous max_num_seqs={seqs} (KV of B={args.batch}: {kv_bytes(args.batch) / 2**20:.0f} MiB)",
              lambda: engine_continuous(engine, workload, f"c{seqs}"), workload)


def compare(args, workload, model, engine_for, kv_bytes) -> None:  # type: ignore[no-untyped-def]
    device, batch, hf_batch = args.device, args.batch, args.hf_batch or args.batch
    continuous, static = engine_for(args.engine_batch, batch), engine_for(batch, batch)
    systems: dict[str, Callable[[int], Run]] = {
        f"continuous (engine, max_num_seqs {args.engine_batch})": lambda r: engine_continuous(continuous, workload, f"c{r}"),
        f"engine-static (same engine, B {batch}, refill when the batch is done)": lambda r: engine_static(static, workload, batch, f"s{r}"),
        f"hf-generate (B {hf_batch}, per-row stopping, {args.hf_cache} cache)": lambda r: hf_generate(model, workload, hf_batch, args.hf_cache, device),
        f"hf-rowdrop (B {hf_batch}, finished rows leave the batch)": lambda r: hf_rowdrop(model, workload, hf_batch, device),
    }
    if args.systems:
        wanted = args.systems.split(",")
        systems = {label: run for label, run in systems.items() if label.split(" (")[0] in wanted}
    runs: dict[str, list[Run]] = {label: [] for label in systems}
    labels = list(systems)
    for r in range(args.repeats):
        print(f"repeat {r + 1}:")
        first = r % len(labels)  # rotated: repeat r starts with system r mod n, so no system always runs first
        for label in labels[first:] + labels[:first]:
            runs[label].append(timed(label.split(" (")[0], lambda: systems[label](r), workload))
    total = sum(workload.max_tokens)
    reference = runs[next(iter(systems))][0].outputs
    rates = {label: sorted(total / run.seconds for run in done) for label, done in runs.items()}
    base = max(statistics.median(rates[label]) for label in list(systems)[1:])
    print(f"engine KV pool {kv_bytes(batch) / 2**20:.0f} MiB = {batch} x ({args.max_prompt} + {args.max_output}) tokens; "
          f"{total} output tokens per run in every system")
    print("| system | output tokens/s, median | min - max | vs the best static | requests identical to continuous | tokens before first divergence |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, done in runs.items():
        same, prefix = agreement(done[0].outputs, reference)
        stable = all(run.outputs == done[0].outputs for run in done)
        median = statistics.median(rates[label])
        print(f"| {label} | {median:.2f} | {rates[label][0]:.2f} - {rates[label][-1]:.2f} | {median / base:.2f}x | "
              f"{same:.0%}{'' if stable else ' (runs differ)'} | {prefix:.1%} |")


if __name__ == "__main__":
    main()
