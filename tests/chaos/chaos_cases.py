"""The chaos cases: each does one hostile thing to a serving deployment and checks what must hold
after it (chaos_harness.py). `CASES` lists them with their expected outcome; `fast` ones run in CI
(tests/chaos/test_chaos.py), all of them from `python bench/chaos.py`.

Most cases share one disaggregated deployment (shm, short deadlines, 2 s read timeouts) and leave it
whole; those that end the deployment (the router killed, SIGTERM) start their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from chaos_harness import (
    MODEL,
    Context,
    Result,
    memfd_inodes,
    reference,
    resilience,
    serve,
    temp_leftovers,
    under_load,
)

STOP_S = 6.0  # how long a SIGSTOPped process stays stopped
MANIFEST = dict(
    mode="disaggregated",
    router={"timeouts": {"inter_token_s": 5, "kv_transfer_s": 10, "prefill_s": 30}},
    transport={"lease_s": 10},
    server={"port": 0, "header_timeout_s": 2, "body_timeout_s": 2},
    runtime={"standby": True},  # workers are killed here: they come back from the spare, as in production
)


def start_context() -> Context:
    return _context(MANIFEST)


def _context(manifest: dict) -> Context:
    dep = serve.start_deployment(serve.manifest_yaml(**manifest))
    try:
        ctx = Context(dep, reference(dep.url))
        ctx.pids()
    except BaseException:
        dep.stop()
        raise
    return ctx


def _summary(streams) -> str:
    counts: dict[str, int] = {}
    for s in streams:
        counts[s.outcome] = counts.get(s.outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


# ---- a worker's process killed or stopped under streaming load ----------------------------------


def worker_fault(ctx: Context, victim: str, process: str, sig: signal.Signals) -> tuple[str, list[str]]:
    pids = ctx.pids()
    pid = pids[f"{victim} {process}"]
    mapped = memfd_inodes(pids["decode-0 engine core"]) if victim.startswith("prefill") else set()
    resumer: list[threading.Timer] = []

    def fault() -> None:
        try:
            resilience._wait_role_busy(ctx.dep, victim.split("-")[0], timeout_s=10)
        except AssertionError:  # a short prefill can end between two looks: the streams are decoding,
            with contextlib.suppress(AssertionError):  # or, on a fast box, already done: strike anyway
                resilience._wait_busy(ctx.dep, timeout_s=2)
        if victim.startswith("decode"):
            time.sleep(0.5)  # tokens are streaming
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            resumer.append(threading.Timer(STOP_S, _signal, (pid, signal.SIGCONT)))
            resumer[0].start()

    restarts = ctx.restarts(victim)
    streams = under_load(ctx.dep.url, fault)
    for t in resumer:
        t.join()
    # the runtime replaces the worker, killed or stopped (the health may read "ok" for a moment)
    ctx.wait_healthy(lambda: ctx.restarts(victim) > restarts, timeout_s=60)
    dead = {p for p in (pid, pids[f"{victim} engine core"]) if resilience._gone(p)}
    problems = ctx.check_after(streams, dead)
    after = ctx.pids()
    if mapped and dead:  # the decode core must drop the dead prefill's KV mapping
        under_load(ctx.dep.url, lambda: None, n=1)  # a fetch from the new prefill
        deadline = time.monotonic() + 5
        while mapped & memfd_inodes(after["decode-0 engine core"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        if mapped & memfd_inodes(after["decode-0 engine core"]):
            problems.append("the decode core still maps the dead prefill's KV")
    restarted = "restarted" if after[f"{victim} front end"] != pids[f"{victim} front end"] else "same process"
    return f"{_summary(streams)}; {restarted}", problems


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def router_stop(ctx: Context) -> tuple[str, list[str]]:
    pid = ctx.dep.proc.pid

    def fault() -> None:
        resilience._wait_busy(ctx.dep)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(pid, signal.SIGCONT)

    streams = under_load(ctx.dep.url, fault)
    return _summary(streams), ctx.check_after(streams, set(), any_failed_ok=False)


# ---- hostile requests beside innocent ones -------------------------------------------------------

HOSTILE = [  # raw bodies: each is refused at admission, none may hurt the streams beside it
    b'"top_k": 9223372036854775808',
    b'"seed": 18446744073709551616',
    b'"stop_token_ids": [99999999999]',
    b'"temperature": NaN',
    b'"repetition_penalty": Infinity',
    b'"max_tokens": ' + b"9" * 5000,
    b'"logit_bias": {"1": 1e400}',
]


def poison(ctx: Context) -> tuple[str, list[str]]:
    statuses: list[int] = []

    def fault() -> None:
        resilience._wait_busy(ctx.dep)
        for field in HOSTILE:
            raw = b'{"model": "' + MODEL.encode() + b'", "prompt": "Count", ' + field + b"}"
            r = httpx.post(f"{ctx.dep.url}/v1/completions", content=raw, timeout=60,
                           headers={"Content-Type": "application/json"})  # fmt: skip
            statuses.append(r.status_code)

    streams = under_load(ctx.dep.url, fault)
    problems = ctx.check_after(streams, set(), any_failed_ok=False)
    if any(s != 400 for s in statuses):
        problems.append(f"hostile statuses {statuses}")
    return f"hostile: {sorted(set(statuses))} x{len(statuses)}; innocents: {_summary(streams)}", problems


def bad_input_battery(ctx: Context) -> tuple[str, list[str]]:
    battery = _bad_input_cases()
    wrong = []
    for name, path, body, status, _param, _word in battery:
        kw = {"json": body} if isinstance(body, dict) else {"content": body}
        r = httpx.post(f"{ctx.dep.url}{path}", headers={"Content-Type": "application/json"}, timeout=60, **kw)
        if r.status_code != status or "Traceback" in r.text:
            wrong.append(f"{name}: {r.status_code}")
    streams = under_load(ctx.dep.url, lambda: None, n=2)
    problems = ctx.check_after(streams, set(), any_failed_ok=False) + wrong
    return f"{len(battery) - len(wrong)}/{len(battery)} as expected; then {_summary(streams)}", problems


def _bad_input_cases() -> list:
    from chaos_harness import _load  # serve_harness, which test_bad_input imports, is loaded by then

    path = os.path.join(os.path.dirname(serve.__file__), "router", "test_bad_input.py")
    return _load("chaos_serve_bad_input", path).CASES


# ---- the HTTP edge: slowloris -------------------------------------------------------------------


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=15)


def _until_closed(conn: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := conn.recv(65536):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    conn.close()
    return got


def slowloris(ctx: Context) -> tuple[str, list[str]]:
    url, seen = ctx.dep.url, {}

    def dribble(i: int) -> None:  # headers a byte at a time
        conn, t0 = _raw(url), time.monotonic()
        try:
            for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
                conn.sendall(bytes([b]))
                time.sleep(0.1)
        except OSError:
            pass
        seen[f"slow headers {i}"] = (_until_closed(conn)[:12], time.monotonic() - t0)

    def huge() -> None:
        conn, t0, sent = _raw(url), time.monotonic(), 0
        try:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            while sent < 16 << 20:
                conn.sendall(b"a" * 65536)
                sent += 65536
        except OSError:
            pass
        seen["16 MiB header"] = (_until_closed(conn)[:12], time.monotonic() - t0)

    def slow_body() -> None:
        conn, t0 = _raw(url), time.monotonic()
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 500\r\n\r\n{")  # fmt: skip
        seen["slow body"] = (_until_closed(conn)[:12], time.monotonic() - t0)

    def fault() -> None:
        threads = [threading.Thread(target=dribble, args=(i,)) for i in range(20)]
        threads += [threading.Thread(target=huge), threading.Thread(target=slow_body)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    streams = under_load(url, fault)
    problems = ctx.check_after(streams, set(), any_failed_ok=False)
    for what, (head, took) in seen.items():
        want = (b"HTTP/1.1 431", b"") if what.startswith("16") else (b"HTTP/1.1 408",)
        if head not in want or took > 8:
            problems.append(f"{what}: {head!r} after {took:.1f}s")
    worst = max(took for _, took in seen.values())
    cut = f"{len(seen)} slow/huge connections cut (slowest {worst:.1f}s)"
    return f"{cut}; innocents: {_summary(streams)}", problems


# ---- manifests ----------------------------------------------------------------------------------

BOMBS = {
    "billion laughs": 'a: &a ["lol","lol"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
    + "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n",
    "16,000 unknown keys": "server:\n" + "".join(f"  k{i}: 1\n" for i in range(16_000)),
    "nesting 5000 deep": "a: " + "[" * 5000 + "]" * 5000,
    "duplicate keys": "server:\n  port: 1\n  port: 2\n",
    "an infinite timeout": "router: {timeouts: {request_s: .inf}}",
    "a microsecond health interval": "runtime: {health_interval_s: 1.0e-6}",
    "2 MiB of comments": "# x\n" * (1 << 19),
}


def manifest_bombs(_ctx: Context | None) -> tuple[str, list[str]]:
    from splitserve.config import ManifestError, parse_manifest

    problems, slowest = [], 0.0
    for name, text in BOMBS.items():
        t0 = time.perf_counter()
        try:
            parse_manifest(text)
            problems.append(f"{name}: accepted")
        except ManifestError as exc:
            if len(str(exc)) > 10_000:  # 20 problems at most (2.4 GB after 60 s before)
                problems.append(f"{name}: a {len(str(exc))}-character error")
        took = time.perf_counter() - t0
        slowest = max(slowest, took)
        if took > 5:
            problems.append(f"{name}: {took:.1f}s")
    return f"{len(BOMBS)} refused, slowest {slowest:.2f}s", problems


# ---- the router: killed, or SIGTERM under load (each on a deployment of its own) -----------------


def _own_deployment(**sections) -> tuple[Context, set[int], str]:
    ctx = _context({**MANIFEST, **sections})
    return ctx, set(ctx.pids().values()), str(ctx.dep.sp.tmpdir)


def _all_gone(pids: set[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(resilience._gone(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if not resilience._gone(p)]


def router_kill(_ctx: Context | None) -> tuple[str, list[str]]:
    ctx, pids, tmpdir = _own_deployment()
    try:
        killed: list[float] = []

        def fault() -> None:
            resilience._wait_busy(ctx.dep)
            ctx.dep.proc.send_signal(signal.SIGKILL)
            killed.append(time.monotonic())

        streams = under_load(ctx.dep.url, fault)
    finally:
        ctx.dep.stop()
    problems = [f"stream ended {s.ended - killed[0]:.1f}s after the kill" for s in streams
                if s.outcome == "hung" or s.ended - killed[0] > 5]  # fmt: skip
    problems += [f"stream {i} wrong" for i, s in enumerate(streams) if not ctx.ref[i % 6].startswith(s.text)]
    left = _all_gone(pids, 20)
    if left:
        problems.append(f"processes left: {left}")
    problems += [f"left: {p}" for p in temp_leftovers(pids, (tmpdir,))]
    return f"{_summary(streams)}; {len(pids) - len(left)}/{len(pids)} processes gone", problems


def sigterm(_ctx: Context | None) -> tuple[str, list[str]]:
    ctx, pids, tmpdir = _own_deployment(runtime={"drain_timeout_s": 20})
    codes: list[int] = []
    try:

        def fault() -> None:
            resilience._wait_busy(ctx.dep)
            ctx.dep.proc.send_signal(signal.SIGTERM)

        streams = under_load(ctx.dep.url, fault, n=6)
        codes.append(ctx.dep.proc.wait(30))
    finally:
        ctx.dep.stop()
    problems = [f"stream {i}: {s.outcome}" for i, s in enumerate(streams)
                if s.outcome not in ("ok", "error: server_shutdown")]  # fmt: skip
    problems += [f"stream {i} wrong" for i, s in enumerate(streams) if not ctx.ref[i % 6].startswith(s.text)
                 or (s.outcome == "ok" and s.text != ctx.ref[i % 6])]  # fmt: skip
    if codes != [0]:
        problems.append(f"exit status {codes}")
    left = _all_gone(pids, 20)
    if left:
        problems.append(f"processes left: {left}")
    problems += [f"left: {p}" for p in temp_leftovers(pids, (tmpdir,))]
    return f"{_summary(streams)}; exit {codes}; {len(pids) - len(left)}/{len(pids)} processes gone", problems


# ---- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    expected: str
    run: Callable[[Context | None], tuple[str, list[str]]]
    fast: bool = False  # in CI (tests/chaos/test_chaos.py)
    shared: bool = True  # uses the shared deployment (else makes its own or none)


def _worker_case(victim: str, process: str, sig: signal.Signals, fast: bool = False) -> Case:
    what = "kill -9" if sig == signal.SIGKILL else f"SIGSTOP {STOP_S:g}s"
    expected = "streams finish exact or fail fast; replaced; pools full; nothing left"
    return Case(f"{what} {victim} {process}", expected,
                lambda ctx: worker_fault(ctx, victim, process, sig), fast)  # fmt: skip


PROCESSES = [(v, p) for v in ("prefill-0", "decode-0") for p in ("front end", "engine core")]
CASES = [
    Case("manifest bombs", "each refused in < 5 s, bounded error", manifest_bombs, fast=True, shared=False),
    Case("slowloris", "408/431 and closed in < 8 s; innocents exact", slowloris, fast=True),
    Case("poison beside innocents", "hostile 400; innocents exact", poison, fast=True),
    _worker_case("prefill-0", "engine core", signal.SIGKILL, fast=True),
    Case("bad-input battery", "each its 4xx; still exact after", bad_input_battery),
    *[_worker_case(v, p, signal.SIGKILL) for v, p in PROCESSES if (v, p) != ("prefill-0", "engine core")],
    *[_worker_case(v, p, signal.SIGSTOP) for v, p in PROCESSES],
    Case("SIGSTOP router 3s", "every stream finishes exact", router_stop),
    Case(
        "kill -9 router",
        "clients end < 5 s; every process gone; nothing left",
        router_kill,
        fast=True,
        shared=False,
    ),
    Case("SIGTERM under load", "drained or server_shutdown; exit 0; nothing left", sigterm, shared=False),
]


def run_case(case: Case, ctx: Context | None) -> Result:
    t0 = time.monotonic()
    try:
        if ctx is not None:
            ctx.wait_healthy()  # whatever the case before did
        outcome, problems = case.run(ctx)
    except Exception as exc:  # noqa: BLE001 - a case that breaks is a failed case, and the suite goes on
        outcome, problems = f"raised {type(exc).__name__}: {exc}"[:200], ["raised"]
    text = outcome if not problems else f"{outcome}; PROBLEMS: {'; '.join(problems)}"
    return Result(case.name, case.expected, text, not problems, time.monotonic() - t0)
