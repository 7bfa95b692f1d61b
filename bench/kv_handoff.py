"""KV handoff between a prefill process and a decode process, against recompute: decode start latency
and total CPU per request, 1,000-token prompts, SmolLM2-135M-Instruct on CPU.

Three processes (multiprocessing, spawn): this one sends requests, a prefill process and a decode
process each load their own `LocalBackend` (pipeline/backends/local.py) from the converted checkpoint.
Both share one `FileKVStore` directory (under /dev/shm when there is one: shared memory).

- handoff: prefill computes the prompt and the first token, `hand_off` writes the sequence's KV into
  the store; the decode process's backend (with the store) imports it by handle and decodes.
- recompute: prefill computes the prompt and the first token and hands nothing off; the decode
  process's second backend (no store) recomputes prompt + first token, then decodes.

Per request (the decode side measured inside the decode process, from the moment it has received the
handle): decode start latency = handle received -> first decoded token available; write + decode
start = the handoff write in the prefill process (export + store write, about 0 in recompute) plus
decode start, what handoff spends after the first token, from which the headline ratio is taken; and
CPU seconds (`time.process_time` deltas: all threads of the process, prefill process + decode
process). Every prompt is distinct from its first token on (its own document number and ShareGPT
text), and every request carries its own tenant (the prefix-cache salt), so neither process can reuse
another request's blocks: recompute really recomputes. Modes alternate per request (ABBA), --repeats
rounds over all prompts; medians with min-max over all requests, ratios paired per (prompt, round).
Greedy: the handoff and recompute outputs must be identical token for token.

    nice -n 5 .venv/bin/python -m bench.kv_handoff [--prompts 8] [--prompt-tokens 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

MODEL_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "models"
MODES = ("handoff", "recompute")


@dataclass(frozen=True)
class PrefillResult:
    prefilled: object  # pipeline.backends.base.Prefilled
    wall_s: float  # prefill (prompt + first token)
    handoff_s: float  # export + store write (0 in recompute mode)
    cpu_s: float  # the prefill process's CPU for both
    published: bool


@dataclass(frozen=True)
class DecodeResult:
    token_ids: tuple[int, ...]
    start_s: float  # handle received -> first decoded token
    wall_s: float  # handle received -> last token
    cpu_s: float  # the decode process's CPU for the whole decode
    imported: int  # 1 when the KV came from the store
    recomputed: int


def _worker(role: str, conn: Connection, store_dir: str, threads: int) -> None:
    """A prefill or decode process: load the backend(s), then serve requests until None arrives."""
    import torch

    from pipeline.backends.local import LocalBackend
    from pipeline.engine.kv_files import FileKVStore
    from pipeline.models import convert_default_model

    torch.set_num_threads(threads)
    path = convert_default_model(MODEL_CACHE)
    store = FileKVStore(Path(store_dir), 2**31, 600.0)
    backends = {"handoff": LocalBackend.from_path(path, name=f"{role}-handoff", kv_store=store)}
    if role == "decode":
        backends["recompute"] = LocalBackend.from_path(path, name="decode-recompute")
    loop = asyncio.new_event_loop()
    serve = _prefill if role == "prefill" else _decode
    conn.send("ready")
    while (message := conn.recv()) is not None:
        conn.send(loop.run_until_complete(serve(backends, *message)))
    for backend in backends.values():
        loop.run_until_complete(backend.aclose())
    loop.close()


async def _prefill(backends, mode: str, request) -> PrefillResult:  # type: ignore[no-untyped-def]
    backend = backends["handoff"]
    cpu, wall = time.process_time(), time.perf_counter()
    prefilled = await backend.prefill(request)
    prefill_s = time.perf_counter() - wall
    published = mode == "handoff" and await backend.hand_off(prefilled)
    handoff_s = time.perf_counter() - wall - prefill_s
    cpu = time.process_time() - cpu
    backend.kv_store.drop(prefilled.handle)  # the decode runs elsewhere: free the parked sequence here
    return PrefillResult(prefilled, prefill_s, handoff_s, cpu, published)


async def _decode(backends, mode: str, request, prefilled) -> DecodeResult:  # type: ignore[no-untyped-def]
    backend = backends[mode]
    before = (backend.handoffs.imported, backend.handoffs.recomputed)
    cpu, wall = time.process_time(), time.perf_counter()
    tokens: list[int] = [prefilled.first_token_id]
    start = 0.0
    async for delta in backend.decode(request, prefilled):
        if not start:
            start = time.perf_counter() - wall
        tokens += delta.token_ids
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    imported, recomputed = backend.handoffs.imported - before[0], backend.handoffs.recomputed - before[1]
    return DecodeResult(tuple(tokens), start, wall, cpu, imported, recomputed)


def build_prompts(count: int, target_tokens: int) -> tuple[list[str], list[int]]:
    """`count` completion-form prompts of about `target_tokens` tokens, distinct from the first token:
    "Document i" then ShareGPT answers from a different place in the file for each."""
    from transformers import AutoTokenizer

    from pipeline.models import convert_default_model
    from pipeline.sharegpt import first_turns

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model(MODEL_CACHE), local_files_only=True)
    answers = [a for _, a in first_turns(40 * count) if len(a) > 200]
    prompts, lengths = [], []
    for i in range(count):
        text = f"Document {i + 1}. Read it, then summarise it in one sentence.\n\n"
        for answer in answers[7 * i :] + answers:
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= target_tokens:
                break
            text += answer[:1500] + "\n"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:target_tokens]
        prompt = str(tokenizer.decode(ids)) + "\n\nSummary: this document"  # mid-sentence: rarely ends at once
        prompts.append(prompt)
        lengths.append(len(tokenizer(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]))
    return prompts, lengths


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))} - {fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts per round")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every prompt, both modes each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    from pipeline.backends.base import GenerationRequest

    prompts, lengths = build_prompts(args.prompts, args.prompt_tokens)
    shm = Path("/dev/shm")
    store_dir = Path(tempfile.mkdtemp(prefix="sluice-kv-bench-", dir=shm if shm.is_dir() else None)) / "kv"
    context = mp.get_context("spawn")
    workers, conns = [], {}
    for role in ("prefill", "decode"):
        ours, theirs = context.Pipe()
        process = context.Process(target=_worker, args=(role, theirs, str(store_dir), args.threads), daemon=True)
        process.start()
        workers.append(process)
        conns[role] = ours
    try:
        for conn in conns.values():
            assert conn.recv() == "ready"
        print(f"prompts: {args.prompts} distinct, {min(lengths)}-{max(lengths)} tokens; {args.max_tokens} completion "
              f"tokens each; {args.threads} torch thread(s) per process; KV store {store_dir.parent} "
              f"({'tmpfs' if str(store_dir).startswith('/dev/shm') else 'disk'}); load average at start "
              f"{os.getloadavg()[0]:.2f}", flush=True)

        def one(mode: str, prompt: str, tag: str) -> tuple[PrefillResult, DecodeResult]:
            request = GenerationRequest(request_id=tag, prompt=prompt, max_tokens=args.max_tokens, tenant=tag)
            conns["prefill"].send((mode, request))
            prefilled: PrefillResult = conns["prefill"].recv()
            conns["decode"].send((mode, request, prefilled.prefilled))
            return prefilled, conns["decode"].recv()

        for mode in MODES:  # warm-up: every code path once, outside the figures
            one(mode, prompts[0][:2000], f"warm-{mode}")
        results: dict[str, list[tuple[PrefillResult, DecodeResult]]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                for mode in MODES if (repeat + i) % 2 == 0 else MODES[::-1]:
                    results[mode].append(one(mode, prompt, f"r{repeat}{mode}{i}"))
                h, r = results["handoff"][-1], results["recompute"][-1]
                if h[0].prefilled.finish_reason is not None:  # the first token ended it: there is no decode
                    print(f"round {repeat + 1} prompt {i + 1}: the first token finished the request; left out")
                    del results["handoff"][-1], results["recompute"][-1]
                    continue
                if h[1].token_ids != r[1].token_ids:
                    raise AssertionError(f"prompt {i} round {repeat + 1}: handoff and recompute outputs differ")
                print(f"round {repeat + 1} prompt {i + 1}: decode start {h[1].start_s:.3f} s handoff / "
                      f"{r[1].start_s:.3f} s recompute; load {os.getloadavg()[0]:.2f}", flush=True)
        report(results, args)
    finally:
        for conn in conns.values():
            conn.send(None)
        for process in workers:
            process.join(timeout=30)
        shutil.rmtree(store_dir.parent, ignore_errors=True)


def written(prefill: PrefillResult, decode: DecodeResult) -> float:
    """Handoff write + decode start: what follows the first token in either mode (the write is 0 in recompute)."""
    return prefill.handoff_s + decode.start_s


def report(results: dict[str, list[tuple[PrefillResult, DecodeResult]]], args: argparse.Namespace) -> None:
    handoff, recompute = results["handoff"], results["recompute"]
    if not all(d.imported == 1 for _, d in handoff) or not all(d.recomputed == 1 for _, d in recompute):
        raise AssertionError("a handoff decode did not import, or a recompute decode did not recompute")
    print(f"\n{len(handoff)} requests per mode ({args.prompts} prompts x {args.repeats} rounds); median (min - max)\n")
    print("| mode | write + decode start s | decode start s (alone) | prefill wall s | handoff write s "
          "| prefill process CPU s | decode process CPU s | total CPU s per request |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, runs in results.items():
        print(f"| {mode} | {spread([written(p, d) for p, d in runs])} | {spread([d.start_s for _, d in runs])} "
              f"| {spread([p.wall_s for p, _ in runs])} | {spread([p.handoff_s for p, _ in runs])} "
              f"| {spread([p.cpu_s for p, _ in runs])} | {spread([d.cpu_s for _, d in runs])} "
              f"| {spread([p.cpu_s + d.cpu_s for p, d in runs])} |")
    pairs = list(zip(handoff, recompute, strict=True))
    start = [written(*r) / written(*h) for h, r in pairs]
    start_alone = [r[1].start_s / h[1].start_s for h, r in pairs]
    saved = [(r[0].cpu_s + r[1].cpu_s) - (h[0].cpu_s + h[1].cpu_s) for h, r in pairs]
    prefill = [r[0].cpu_s for r in recompute]  # the prefill's own cost, without the handoff write
    print(f"\nwrite + decode start, recompute / handoff: **{spread(start, '{:.1f}')}x** (target >= 5x); "
          f"decode start alone (without the write): {spread(start_alone, '{:.1f}')}x")
    ratio = [s / p for s, p in zip(saved, prefill, strict=True)]
    print(f"total CPU saved per request: {spread(saved)} s; the prefill's CPU: {spread(prefill)} s; "
          f"saved / prefill: **{spread(ratio, '{:.2f}')}** (target >= 1)")
    print(f"outputs identical in both modes: yes ({len(handoff)} pairs); load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
