"""What crosses a process edge: the worker HTTP API's bodies (http.py, router <-> worker), the front end <->
engine core messages (core.py), and the worker API's auth headers (auth.py)."""
