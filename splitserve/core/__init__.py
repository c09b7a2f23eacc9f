"""The engine-core process of a worker: its loop (loop.py, `python -m splitserve.core.loop`), its engine
and KV connector opened at start (setup.py), the worker operations it runs (ops.py), how their errors
travel (errors.py) and the cores CPU workers lend each other (share.py)."""
