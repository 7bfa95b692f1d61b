"""The cache worker: `python -m workers.cache` runs the cache stage as its own process (consumer group `cache`)."""

from workers.main import run_worker

if __name__ == "__main__":
    run_worker("cache")
