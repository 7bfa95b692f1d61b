"""Continuous batching (the engine) against static batching (transformers `generate` on padded
batches), same model, same ShareGPT prompts, same max_tokens per request, greedy, stopping at EOS.

Output tokens/s counts each request's own tokens (up to its EOS or max_tokens) in both systems; a
static batch runs until its last member ends. All rows run in this one process, one after the other.

Two engine rows, both with the KV memory a static batcher must reserve for its batch (every member at
max_prompt + max_output tokens, the worst case it has to fit):
- equal concurrency: max_num_seqs = the static batch size;
- the engine's own setting (--engine-batch): paging fills that same memory with as many running
  sequences as their actual lengths allow (preempting by recompute when it runs out), which is the
  comparison the continuous-batching papers (Orca, vLLM) make.

    .venv/bin/python -m bench.continuous_batching [--requests 64] [--batch 8] [--engine-batch 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.engine_common import add_model_args, load_model, make_engine, peak_rss_mib, sharegpt_workload, sync
from pipeline.engine.config import EngineConfig, ModelConfig
from pipeline.engine.params import EngineRequest

EOS = 2


def static_batching(model, workload, batch: int, device: str) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(workload.prompt_ids), batch):
        prompts = workload.prompt_ids[i : i + batch]
        limits = workload.max_tokens[i : i + batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), EOS, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(limits), do_sample=False,
                eos_token_id=EOS, pad_token_id=EOS,
            )
        for row, limit in enumerate(limits):
            new = out[row, width:].tolist()[:limit]
            tokens += new.index(EOS) + 1 if EOS in new else len(new)
    sync(device)
    return tokens, time.perf_counter() - start


def continuous_batching(engine, workload) -> tuple[int, float, int]:  # type: ignore[no-untyped-def]
    """(output tokens, seconds, preemptions): `LLMEngine.generate`'s loop, counting preemptions."""
    start = time.perf_counter()
    seqs = [
        engine.add_request(EngineRequest(p, max_tokens=m, stop_token_ids=frozenset({EOS})))
        for p, m in zip(workload.prompt_ids, workload.max_tokens, strict=True)
    ]
    preemptions = 0
    while engine.has_unfinished():
        output = engine.scheduler.schedule()
        engine.scheduler.update_from_output(output, engine.execute(output))
        preemptions += len(output.preempted)
    sync(engine.config.device)
    return sum(len(s.completion_ids) for s in seqs), time.perf_counter() - start, preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="static batch size (and the equal-concurrency engine row)")
    parser.add_argument("--engine-batch", type=int, default=32, help="the engine's max_num_seqs in the same KV memory")
    parser.add_argument("--max-prompt", type=int, default=192)
    parser.add_argument("--max-output", type=int, default=1024, help="clip ShareGPT answer lengths to this")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = load_model(args)
    workload = sharegpt_workload(tokenizer, args.requests, args.max_prompt, args.max_output)
    per_token = ModelConfig.from_dict(model.config.to_dict()).kv_bytes_per_token(getattr(torch, args.dtype).itemsize)
    kv_bytes = args.batch * (args.max_prompt + args.max_output) * per_token  # a static batch's worst case

    def engine_for(max_num_seqs: int):  # type: ignore[no-untyped-def]
        config = EngineConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=512, device=args.device, dtype=args.dtype, kv_cache_bytes=kv_bytes
        )
        engine = make_engine(model, config)
        engine.generate([EngineRequest(workload.prompt_ids[0], max_tokens=2)])  # warm-up
        return engine

    static_batching(model, type(workload)(workload.prompt_ids[:1], [2]), 1, args.device)  # warm-up
    static_tokens, static_s = static_batching(model, workload, args.batch, args.device)
    rows = [(f"static batching (transformers generate, batch {args.batch}, padded)", static_tokens, static_s, "")]
    for seqs, label in ((args.batch, "equal concurrency"), (args.engine_batch, "same KV memory")):
        engine = engine_for(seqs)
        tokens, seconds, preemptions = continuous_batching(engine, workload)
        rows.append((f"continuous batching (engine, max_num_seqs {seqs}, {label})", tokens, seconds, f"{preemptions} preemptions"))
    weights = "random weights, 1.1B Llama shape" if args.random_weights else "SmolLM2-135M-Instruct"
    print(f"model: {weights}; device {args.device}, {args.dtype}; {len(workload.prompt_ids)} ShareGPT prompts, "
          f"prompt tokens mean {sum(map(len, workload.prompt_ids)) / len(workload.prompt_ids):.0f}, "
          f"max_tokens mean {sum(workload.max_tokens) / len(workload.max_tokens):.0f} (clipped to [4, {args.max_output}]); "
          f"engine KV pool {kv_bytes / 2**20:.0f} MiB = {args.batch} x ({args.max_prompt} + {args.max_output}) tokens")
    print("| system | output tokens | seconds | output tokens/s | ratio | notes |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = static_tokens / static_s
    for label, tokens, seconds, notes in rows:
        print(f"| {label} | {tokens} | {seconds:.1f} | {tokens / seconds:.2f} | {tokens / seconds / base:.2f}x | {notes} |")
    print("target >= 3x")
    runner = engine.runner
    print(f"KV bytes per token: {runner.kv_bytes_per_token} ({runner.model_config.num_layers} layers x 2 x "
          f"{runner.model_config.num_kv_heads} kv heads x {runner.model_config.head_dim} x {runner.dtype.itemsize} B); "
          f"pool {runner.num_blocks} blocks of {engine.config.block_size}; peak RSS {peak_rss_mib():.0f} MiB")
    if args.device.startswith("cuda"):
        print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
