"""HTTP-server pieces the router and the worker both use: the listening socket (listen.py) and the guard on
slow or oversized requests (edge_guard.py)."""
