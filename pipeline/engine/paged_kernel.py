"""The compiled decode-attention kernel (`csrc/paged_decode.cpp`): keys and values read in place from
the paged KV pool, where the torch path first gathers each sequence's blocks into a padded copy and runs
a masked attention over it (a decode step of 32 sequences at 700 tokens of context: 507 ms that way,
285 with the kernel; the gather alone copies as many bytes as the kernel reads; docs/benchmarks.md).

Built once per virtual environment with PyTorch's C++ extension loader (g++ and ninja; `make setup` builds
it, the first engine in an environment without the build does it in about half a minute) into
`torch_extensions/` inside the environment (`TORCH_EXTENSIONS_DIR` when set), under a name that includes
this CPU's instruction sets, since the build targets them (-march=native). One directory per environment:
the loader rebuilds whenever its include paths change, so .venv and .venv-triton (the Triton server's
sluice_llm), or two checkouts, sharing ~/.cache/torch_extensions rebuilt it in turn, ~35 s each time.
Where it cannot be built the engine logs why once and attends with the torch path;
`EngineConfig.decode_kernel = false` chooses the torch path outright.

    .venv/bin/python -m pipeline.engine.paged_kernel     # build it now (make setup runs this)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
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
        name = f"sluice_paged_decode_{tag}"
        build = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions") / name
        build.mkdir(parents=True, exist_ok=True)
        module = load(
            name=name,
            build_directory=str(build),
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
