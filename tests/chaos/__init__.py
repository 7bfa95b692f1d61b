"""The chaos suite: sluice's streams under SIGKILL, SIGSTOP, broker and Redis restarts (issue 9).

    scenarios.py   the profiles: what is sent and what is broken, and when
    harness.py     the run's own Kafka and Redis (each restartable alone), the config file, topic creation
    supervisor.py  the worker processes: started, killed, paused, added and removed by PID, restarted
    clients.py     streaming requests through the SDK, every chunk recorded with its arrival time
    checker.py     reads every topic, checks the invariants, computes the numbers and the report
    run.py         `python -m tests.chaos.run --profile short|full --report out.json`
    test_chaos.py  the short profile in `make test`, the full one under `-m chaos` (`make chaos`)
"""
