"""The postguard worker: `python -m workers.postguard` runs the postguard stage as its own process (consumer group `postguard`)."""

from workers.main import run_worker

if __name__ == "__main__":
    run_worker("postguard")
