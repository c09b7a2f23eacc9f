"""Serving: the worker service around one engine (worker.py, worker_app.py) and its HTTP bodies."""
