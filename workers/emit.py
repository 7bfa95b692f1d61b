"""The emit worker: `python -m workers.emit` runs the emit stage as its own process (consumer group `emit`)."""

from workers.main import run_worker

if __name__ == "__main__":
    run_worker("emit")
