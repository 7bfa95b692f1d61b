"""The guard worker: `python -m workers.guard` runs the guard stage as its own process (consumer group `guard`)."""

from workers.main import run_worker

if __name__ == "__main__":
    run_worker("guard")
