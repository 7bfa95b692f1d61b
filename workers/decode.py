"""The decode worker: `python -m workers.decode` runs the decode stage as its own process (consumer group `decode`)."""

from workers.main import run_worker

if __name__ == "__main__":
    run_worker("decode")
