"""The route worker: `python -m workers.route` runs the route stage as its own process (consumer group `route`)."""

from workers.main import run_worker

if __name__ == "__main__":
    run_worker("route")
