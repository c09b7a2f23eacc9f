"""Prefill and decode scaled apart by their SLOs: a controller that reads the router's TTFT and ITL, queue
depth and KV usage per role, and adds or removes one replica of one role at a time (controller.py)."""
