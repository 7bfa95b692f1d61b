"""What every `workers/<stage>.py` runs (pipeline.process.run_worker), kept for `python -m workers.X`."""

from pipeline.process import run_worker

__all__ = ["run_worker"]
