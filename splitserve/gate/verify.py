"""`splitserve verify`: the deployment gate. It fails closed: exit 0 only when every check passes.

Against a running deployment (`--url`) or one it starts from a manifest (and stops afterwards):
  deployment   every worker ready; none restarting or given up on
  per worker   the device and dtype it reports; the KV backend it actually instantiated (its transport's
               own report, never the manifest: "nixl/UCX" for nixl) is one of
               `transport.required_backends`: a fallback passes only where the manifest names what it
               fell back to there ("nixl/UCX"); KV transfer failures within `verify.max_transfer_failures`;
               the host's RDMA fabric (EFA / InfiniBand devices, GPUDirect RDMA or staging through host
               memory; one line where there are none), failing a GPU worker without GPUDirect RDMA when
               `verify.require_gpudirect` is set
  per pair     (every prefill worker x every decode worker)
               handshake   the decode worker connects to the prefill worker now: layouts and the shared
                           secret must match, the layout fingerprints are reported
               latency     one-block probes over the real transport: the median of LATENCY_PROBES,
                           after the pair's first fetch (first use: connection, IPC handles), shown apart
               bandwidth   a `verify.probe_mb` probe (real blocks, real transport) >= `verify.min_gbps`
               round trip  `verify.prompt`, greedy, prefilled on this prefill worker, KV moved, decoded on
                           this decode worker: the text and token ids must equal the same request run
                           whole on one engine (colocated), and the transfer's share of that TTFT must
                           be <= `verify.max_transfer_share`
  the split    probe requests through the router, every worker's counters read before and after
               (split.py): the prefill pool prefilled them, no decode worker recomputed a handed-off
               prompt, and the handoff moved at least the prompt's KV bytes per token
The report is a table on stdout and, with `--json PATH`, JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from splitserve.config.manifest import Manifest
from splitserve.gate.split import check_split
from splitserve.router.probe import ProbeError, blocks_for, probe_pair
from splitserve.wire.auth import worker_headers
from splitserve.wire.http import (
    LINE_DECODER,
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResponse,
)

LATENCY_PROBES = 5  # one-block probes timed after the pair's first (which pays set-up: 5.71 ms, then 0.71)


@dataclass
class Check:
    name: str
    scope: str
    ok: bool
    detail: str
    value: Any = None


@dataclass
class Report:
    target: str
    checks: list[Check] = field(default_factory=list)
    error: str | None = None  # the gate could not run at all (counts as a failure)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    def add(self, name: str, scope: str, ok: bool, detail: str, value: Any = None) -> None:
        self.checks.append(Check(name, scope, bool(ok), detail, value))

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "ok": self.ok,
            "error": self.error,
            "checks": [asdict(c) for c in self.checks],
        }

    def table(self) -> str:
        rows = [("CHECK", "SCOPE", "RESULT", "DETAIL")]
        rows += [(c.name, c.scope, "pass" if c.ok else "FAIL", c.detail) for c in self.checks]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows]
        if self.error:
            lines.append(f"error: {self.error}")
        failed = sum(not c.ok for c in self.checks)
        verdict = "PASS" if self.ok else f"FAIL ({failed} of {len(self.checks)} checks failed)"
        lines.append(f"verify {self.target}: {verdict}")
        return "\n".join(lines)


async def verify_url(
    url: str, api_key: str | None = None, secret: str | None = None, timeout_s: float = 60.0
) -> Report:
    """`api_key`: the router's (if it has keys); `secret`: the deployment's KV secret, from which the
    workers' API token derives (default: $SPLITSERVE_KV_SECRET)."""
    report = Report(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    secret = secret or os.environ.get("SPLITSERVE_KV_SECRET")
    async with httpx.AsyncClient(timeout=timeout_s, headers=worker_headers(secret)) as http:
        try:
            r = await http.get(f"{url}/admin/deployment", headers=headers)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            report.error = f"could not read {url}/admin/deployment: {exc}"
            return report
        dep = r.json()
        ready = [w for w in dep["workers"] if w["state"] == "ready"]
        if ready and (await http.get(f"{ready[0]['url']}/stats")).status_code == 401:
            report.error = (
                "the workers refused our token: run verify with the deployment's secret in "
                "the environment variable its manifest names (transport.secret_env)"
            )
            return report
        await _check(http, dep, report, timeout_s)
        if dep["mode"] == "disaggregated" and any(c.name == "round trip" for c in report.checks):
            await check_split(http, url, headers, dep, report)  # split.py: the split really happens
    return report


async def _check(http: httpx.AsyncClient, dep: dict, report: Report, timeout_s: float) -> None:
    v, t = dep["verify"], dep["transport"]
    required = t["required_backends"]
    workers = dep["workers"]
    down = [f"{w['name']} ({w['state']})" for w in workers if w["state"] != "ready"]
    report.add(
        "workers ready",
        "deployment",
        not down,
        "all ready" if not down else "not ready: " + ", ".join(down),
        len(workers) - len(down),
    )
    ready = [w for w in workers if w["state"] == "ready"]
    stats: dict[str, dict] = {}
    for w in ready:
        h = (await http.get(f"{w['url']}/health")).json()
        s = (await http.get(f"{w['url']}/stats")).json()
        w["info"], stats[w["name"]] = h, s
        report.add(
            "device", w["name"], True, f"{h.get('device')} {h.get('dtype')}, restarts {w.get('restarts', 0)}"
        )
        load = h.get("load") or {}
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in (load.get("seconds") or {}).items())
        started = f"; ready {w['startup_s']:.1f}s after spawn" if w.get("startup_s") else ""
        cache = (load.get("cache") or {}).get("status", "off")
        total = load.get("total_seconds") or 0.0
        detail = f"{load.get('method', '?')}, cache {cache}: {total:.2f}s ({stages}){started}"
        report.add("weights", w["name"], True, detail, load.get("total_seconds"))
        if w["role"] == "colocated":
            continue
        transfer = s.get("kv_transfer") or {}
        tr = transfer.get("transport") or {}
        actual, asked = transfer.get("backend"), tr.get("requested") or t["backend"]
        why = "; ".join(tr.get("fallback_reasons") or [])
        ok = actual in required  # a fallback's backend is there only when the manifest accepts it
        detail = f"runs {actual} (asked {asked}); required {', '.join(required)}"
        if why:
            detail += f"; FELL BACK{' (accepted by required_backends)' if ok else ''} because: {why}"
        report.add("kv backend", w["name"], ok, detail, actual)
        _check_fabric(report, w["name"], tr.get("fabric"), str(h.get("device") or ""), v)
        fails = sum((transfer.get("failures") or {}).values())
        report.add(
            "kv failures",
            w["name"],
            fails <= v["max_transfer_failures"],
            f"{fails} failed transfers (allowed {v['max_transfer_failures']}): "
            f"{transfer.get('failures') or {}}",
            fails,
        )
    if dep["mode"] != "disaggregated":
        report.add("kv transport", "deployment", True, "colocated: no KV moves between workers")
        return
    prefills = [w for w in ready if w["role"] == "prefill"]
    decodes = [w for w in ready if w["role"] == "decode"]
    if not prefills or not decodes:
        report.add("pairs", "deployment", False, "no ready prefill/decode pair to check")
        return
    for p in prefills:
        for d in decodes:
            await _check_pair(http, p, d, v, report, timeout_s)


def _check_fabric(report: Report, name: str, fabric: dict | None, device: str, v: dict) -> None:
    """What RDMA fabric the worker's host has and the path KV takes over it (transport/fabric.py); with
    `verify.require_gpudirect`, a GPU worker without GPUDirect RDMA fails. The bandwidth probe of each
    pair measures that path against `verify.min_gbps`."""
    if not fabric:
        return
    need = bool(v.get("require_gpudirect")) and device.startswith("cuda")
    ok = not need or bool(fabric.get("gpudirect"))
    detail = str(fabric.get("path"))
    if not ok:
        detail += "; the manifest requires GPUDirect RDMA (verify.require_gpudirect)"
    report.add("fabric", name, ok, detail, fabric.get("kinds"))


async def _check_pair(
    http: httpx.AsyncClient, p: dict, d: dict, v: dict, report: Report, timeout_s: float
) -> None:
    scope = f"{p['name']} -> {d['name']}"
    r = await http.post(f"{d['url']}/kv/connect", json={"address": p["kv_address"], "timeout_s": 10})
    if r.status_code != 200:
        report.add("handshake", scope, False, _err(r))
        return
    fp_p, fp_d = p["info"].get("layout_fingerprint"), d["info"].get("layout_fingerprint")
    report.add("handshake", scope, fp_p == fp_d, f"layout fingerprint {fp_p} / {fp_d}", fp_p)
    block_bytes = int(d["info"].get("block_bytes") or 1 << 20)
    try:
        # the pair's first fetch pays for first use (connection, IPC handles, kernels): apart, untimed
        first = await probe_pair(http, p["url"], d["url"], 1, timeout_s)
        ones = [await probe_pair(http, p["url"], d["url"], 1, timeout_s) for _ in range(LATENCY_PROBES)]
        small = sorted(ones, key=lambda x: x["seconds"])[len(ones) // 2]  # the median
        report.add(
            "latency",
            scope,
            True,
            f"{small['seconds'] * 1e3:.2f} ms for one block ({block_bytes / 1024:.0f} KiB) over "
            f"{small['backend']}, median of {len(ones)} (the pair's first fetch: "
            f"{first['seconds'] * 1e3:.2f} ms)",
            small["seconds"],
        )
        n = min(
            blocks_for(v["probe_mb"], block_bytes),
            int(p["info"]["num_blocks"]) // 2,
            int(d["info"]["num_blocks"]) // 2,
        )
        runs = [await probe_pair(http, p["url"], d["url"], n, timeout_s) for _ in range(3)]
        best = max(runs, key=lambda x: x["gbps"])
        ok = best["gbps"] >= v["min_gbps"] and best["backend"] == small["backend"]
        report.add(
            "bandwidth",
            scope,
            ok,
            f"{best['gbps']:.3f} GB/s over {best['backend']} "
            f"({best['bytes'] / 2**20:.0f} MiB, best of 3; floor {v['min_gbps']} GB/s)",
            best["gbps"],
        )
    except (ProbeError, httpx.HTTPError) as exc:
        report.add("bandwidth", scope, False, f"probe failed: {exc}")
    await _round_trip(http, p, d, v, scope, report, timeout_s)


async def _round_trip(
    http: httpx.AsyncClient, p: dict, d: dict, v: dict, scope: str, report: Report, timeout_s: float
) -> None:
    params = {"temperature": 0, "max_tokens": v["max_tokens"], "ignore_eos": True}
    whole = GenerateRequest(prompt=v["prompt"], sampling_params=params, stream=False)
    ref = await http.post(f"{p['url']}/generate", json=whole.model_dump())
    if ref.status_code != 200:
        report.add("round trip", scope, False, f"the colocated reference failed: {_err(ref)}")
        return
    expected = LINE_DECODER.decode(ref.content)
    start = time.perf_counter()
    ask = PrefillRequest(prompt=v["prompt"], sampling_params=params)
    pre = await http.post(f"{p['url']}/prefill", json=ask.model_dump())
    if pre.status_code != 200:
        report.add("round trip", scope, False, f"prefill failed: {_err(pre)}")
        return
    pj = PrefillResponse.model_validate_json(pre.content)
    if pj.kv_export is None:
        report.add("round trip", scope, False, "the prompt finished at its first token: nothing to move")
        return
    body = DecodeRequest(
        prompt_token_ids=pj.prompt_token_ids, first_token=pj.first_token, kv_export=pj.kv_export,
        sampling_params=params, stream=True, timeout_s=timeout_s,
    )  # fmt: skip
    tokens: list[int] = []
    text, ttft, metrics = "", None, {}
    async with http.stream("POST", f"{d['url']}/decode", json=body.model_dump()) as resp:
        if resp.status_code != 200:
            report.add(
                "round trip",
                scope,
                False,
                f"decode failed: {_err_bytes(resp.status_code, await resp.aread())}",
            )
            return
        async for raw in resp.aiter_lines():
            if not raw:
                continue
            line = LINE_DECODER.decode(raw)
            if ttft is None:
                ttft, metrics = time.perf_counter() - start, line.metrics or {}
            tokens += line.token_ids
            text += line.text
    same = tokens == expected.token_ids and text == expected.text
    detail = (
        f"{len(tokens)} tokens equal colocated"
        if same
        else f"DIFFERS: {text!r} vs colocated {expected.text!r}"
    )
    report.add("round trip", scope, same, detail, text)
    kv_s = float(metrics.get("kv_fetch_s") or 0.0) + float(metrics.get("kv_wait_s") or 0.0)
    share = kv_s / ttft if ttft else 1.0
    report.add(
        "transfer share",
        scope,
        share <= v["max_transfer_share"],
        f"KV {kv_s * 1e3:.2f} ms of TTFT {ttft * 1e3 if ttft else 0:.1f} ms = {share:.1%} "
        f"(max {v['max_transfer_share']:.0%}; {metrics.get('kv_bytes', 0) / 1024:.0f} KiB over "
        f"{metrics.get('kv_backend')})",
        share,
    )


def _err(r: httpx.Response) -> str:
    return _err_bytes(r.status_code, r.content)


def _err_bytes(status: int, content: bytes) -> str:
    try:
        return f"{status}: {json.loads(content)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {content[:200].decode(errors='replace')}"


def verify_manifest(manifest: Manifest, timeout_s: float = 60.0) -> Report:
    """Start the manifest's deployment, verify it, stop it. A deployment that does not start fails."""
    from splitserve.runtime.process import start_serve

    manifest = manifest.model_copy(deep=True)
    manifest.server.port = 0
    keys = manifest.server.keys()
    env = manifest.transport.secret_env
    secret = manifest.transport.secret or os.environ.setdefault(env, secrets.token_hex(32))  # the child's too
    try:
        sp = start_serve(manifest)
    except RuntimeError as exc:
        report = Report(f"manifest ({manifest.name})")
        tail = [line for line in str(exc).splitlines() if "rror" in line][-3:]
        report.error = "the deployment did not start: " + (" | ".join(tail) or str(exc)[-500:])
        return report
    try:
        report = asyncio.run(verify_url(sp.url, keys[0] if keys else None, secret, timeout_s))
        report.target = f"{sp.url} (started from manifest {manifest.name})"
        return report
    finally:
        sp.stop()


__all__ = ["Check", "Report", "verify_manifest", "verify_url"]
