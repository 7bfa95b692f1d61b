"""The prefill worker: `python -m workers.prefill` runs the prefill stage as its own process (consumer group `prefill`)."""

from workers.main import run_worker

if __name__ == "__main__":
    run_worker("prefill")
