"""The ingest worker: `python -m workers.ingest` runs the ingest stage as its own process (consumer group `ingest`)."""

from workers.main import run_worker

if __name__ == "__main__":
    run_worker("ingest")
