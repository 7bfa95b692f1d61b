"""One runnable module per stage: `python -m workers.<stage>` binds its handler to its topics."""
