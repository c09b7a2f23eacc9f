"""What crosses a process edge, as msgspec structs both sides import (one module per edge):

    http.py       router (and gate, runtimes) <-> worker: the HTTP bodies, stream lines, timings
    core.py       worker front end <-> its engine core: commands, per-step batches, events (msgpack)
    ops.py        the operations a front end asks of its core, and their answers (also HTTP bodies)
    stats.py      a worker's health and stats
    kv_handle.py  the KV handle, the one type from the prefill engine to the decode engine
    auth.py       the worker API's bearer token
    role.py       a worker's role change: the admin body, the runtime's call, the role stamp of calls
    lifecycle.py  a worker process's lines to and from its runtime

Sampling parameters and token logprobs are the sampling leaf's own structs (splitserve/sampling), used
as they are on every wire. tests/wire/test_wire_types.py keeps every field typed.
"""
