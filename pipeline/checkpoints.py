"""Converted checkpoints on disk: a conversion writes into a staging directory, verifies it, writes
MARKER last, then publishes it with one rename. Torch-free, so readers that only check for a
converted directory (the guard) need not import the converters."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["MARKER", "MODEL_DIRNAME", "is_converted", "publish_checkpoint"]

MODEL_DIRNAME = "smollm2-135m-instruct"  # the default model's converted checkpoint, under the model cache
MARKER = ".sluice-converted"  # written last: its presence means the checkpoint is complete and verified


def is_converted(target: Path) -> bool:
    return (target / MARKER).exists()


def publish_checkpoint(staging: Path, target: Path) -> Path:
    """Moves a verified checkpoint (its marker written) from `staging` to `target` in one rename, so a
    reader never sees half a checkpoint; a concurrent conversion that finished first wins."""
    if target.exists() and not is_converted(target):
        shutil.rmtree(target)  # an incomplete earlier attempt
    try:
        staging.rename(target)
    except OSError:
        if not is_converted(target):
            raise
        shutil.rmtree(staging)  # another process finished the same conversion first
    return target
