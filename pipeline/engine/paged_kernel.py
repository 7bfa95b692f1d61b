"""The compiled decode-attention kernel (`csrc/paged_decode.cpp`): keys and values read in place from
the paged KV pool, where the torch path first gathers each sequence's blocks into a padded copy and runs
a masked attention over it (a decode step of 32 sequences at 700 tokens of context: 507 ms that way,
285 with the kernel; the gather alone copies as many bytes as the kernel reads; docs/benchmarks.md).

Built once per machine with PyTorch's C++ extension loader (g++ and ninja; `make setup` builds it, the
first engine on a machine without the build does it in about a minute) into PyTorch's extensions
directory (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions), under a name that includes this
CPU's instruction sets, since the build targets them (-march=native). Where it cannot be built the engine
logs why once and attends with the torch path; `EngineConfig.decode_kernel = false` chooses the torch
path outright.

    .venv/bin/python -m pipeline.engine.paged_kernel     # build it now (make setup runs this)
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["paged_decode"]

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def paged_decode() -> PagedDecode | None:
    """The kernel, or None where it cannot be built (no compiler, no ninja): the caller falls back."""
    try:
        from torch.utils.cpp_extension import load

        tag = hashlib.sha256(_cpu_flags().encode()).hexdigest()[:8]
        module = load(
            name=f"sluice_paged_decode_{tag}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # noqa: BLE001 - any failure to build or load means the torch path
        log.warning("paged decode kernel not available, decode attention gathers blocks in torch: %s", str(exc)[:300])
        return None
    return module.paged_decode  # type: ignore[no-any-return]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("paged decode kernel:", "built" if paged_decode() is not None else "not available (see the warning)")
