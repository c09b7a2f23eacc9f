"""The varlen fla path and the per-chunk torch rule of one Gated DeltaNet layer, each against an fp64
computation of the same layer (CUDA with fla-core): which of the two is the less exact, and where.

The layer, weights, batch (3 decode rows, then prefill chunks of 1, 2, 9, 70 and 130 tokens) and state
slots are those of tests/gpu/test_gdn_fla.py::test_layer_fla_matches_torch (splitserve/model/gdn_case.py).
The fp64 layer runs on the CPU with the gated delta rule replaced by an fp64 token-by-token recurrence.
Stages compared:

- the whole layer's output and its conv and recurrent states (fla path, torch path, each vs fp64);
- the conv + SiLU (the q, k, v each path feeds to its rule);
- the rule alone on the fla path's own inputs: fla's forward kernels, fla with the decay gate computed
  in torch instead of in its kernel, the torch chunked rule; fp32 inputs and bf16-rounded ones;
- the rule's error by position in each prompt (64-token chunks of fla and of the torch rule).

Each precision setting runs in its own process (own Triton cache): `default` (Triton's fp32 dots in
tf32), `ieee` (TRITON_F32_DEFAULT=ieee), `ieee+tril` (also fla's triangular-solve dots in ieee).

    python bench/gdn_fla_precision.py                  # all three settings, a table at the end
    python bench/gdn_fla_precision.py --child ieee     # one setting, JSON
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {
    "default": {},
    "ieee": {"TRITON_F32_DEFAULT": "ieee"},
    "ieee+tril": {"TRITON_F32_DEFAULT": "ieee", "FLA_TRIL_PRECISION": "ieee"},
}
DTYPES = (torch.float32,)  # the rule-alone check (bfloat16 too: more kernels to compile)
DEV = os.environ.get("GDN_DIAG_DEVICE", "cuda")  # "cpu": a dry run of this script (torch rule for fla)


def rule64(q, k, v, g, beta, state):  # noqa: ANN001, ANN201
    """fp64 recurrence for one sequence: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state
    [Hv, Dk, Dv] -> (out [T, Hv, Dv], final state)."""
    q, k, v, g, beta, s = (x.double().cpu() for x in (q, k, v, g, beta, state))
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", s, k[t])
        s = s + k[t][:, :, None] * ((v[t] - pred) * beta[t][:, None])[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


def _chunk64(q, k, v, g, beta, initial_state, **_):  # noqa: ANN001, ANN202, ANN003
    outs, finals = [], []
    for i in range(q.shape[0]):
        o, s = rule64(q[i], k[i], v[i], g[i], beta[i], initial_state[i])
        outs.append(o)
        finals.append(s)
    return torch.stack(outs), torch.stack(finals)


def _stats(got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-4) -> dict:
    got, ref = got.double().cpu(), ref.double().cpu()
    err = (got - ref).abs()
    bad = err > tol + tol * ref.abs()
    return {
        "max_abs": float(err.max()),
        "rel_norm": float(err.norm() / ref.norm().clamp_min(1e-30)),
        "bad_frac_2e-4": float(bad.float().mean()),
    }


def child(setting: str) -> dict:
    if setting == "ieee+tril":  # before fla's kernels compile: its triangular solve's dots in ieee
        import fla.ops.gated_delta_rule.chunk_fwd as cf
        import triton.language as tl

        cf.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
    from splitserve.model import gdn_layer, gdn_prefill
    from splitserve.model.decoder import ForwardContext
    from splitserve.model.gdn_case import gdn_layer_case

    if DEV == "cpu":
        gdn_prefill.VARLEN_RULE = gdn_prefill.torch_varlen_rule
    case = gdn_layer_case(DEV)
    layer, states, meta, x = case.layer, case.states, case.meta, case.x
    ref_states = {k: v.clone() for k, v in states.items()}
    # fp64, but the conv windows: the layer stores them as fp32 (a rounding of 6e-8, far below the errors)
    st64 = {"conv": states["conv"].cpu().clone(), "recurrent": states["recurrent"].double().cpu()}
    cap: dict = {}
    orig_rule, orig_chunk = gdn_layer.varlen_rule, gdn_layer.chunk_gated_delta_rule

    def rec_rule(lp, q, k, v, a, b, A_log, dt_bias, rec_states):  # noqa: ANN001, ANN202
        # q, k, v: the prefill rows only; a, b: all rows of the step
        cap["fla_in"] = [t.clone() for t in (q, k, v, a, b)] + [rec_states[lp.slots].clone(), lp]
        return orig_rule(lp, q, k, v, a, b, A_log, dt_bias, rec_states)

    torch_qkv: list = []

    def rec_chunk(q, k, v, g, beta, s):  # noqa: ANN001, ANN202
        torch_qkv.append((q[0].clone(), k[0].clone(), v[0].clone()))
        return orig_chunk(q, k, v, g, beta, s)

    with torch.no_grad():
        gdn_layer.chunk_gated_delta_rule = rec_chunk
        ref = layer(x, ForwardContext(None, meta, torch.empty(0), ref_states))
        gdn_layer.chunk_gated_delta_rule = orig_chunk
        layer.varlen = True
        gdn_layer.varlen_rule = rec_rule
        lp = gdn_prefill.build_linear_prefill(meta, x.device)
        out = layer(x, ForwardContext(None, meta, torch.empty(0), states, linear_prefill=lp))
        gdn_layer.varlen_rule = orig_rule
        # fp64 on the CPU: same layer, rule replaced by the fp64 recurrence
        l64 = copy.deepcopy(layer).double().cpu()
        l64.varlen = False
        qkv64: list = []

        def chunk64(q, k, v, g, beta, s):  # noqa: ANN001, ANN202
            qkv64.append((q[0].clone(), k[0].clone(), v[0].clone()))
            return _chunk64(q, k, v, g, beta, s)

        gdn_layer.chunk_gated_delta_rule, gdn_layer.recurrent_gated_delta_rule = chunk64, _chunk64
        on_cpu = {"slot_mapping": meta.slot_mapping.cpu(), "seq_slots": meta.seq_slots.cpu()}
        meta64 = dataclasses.replace(meta, **on_cpu)
        out64 = l64(x.double().cpu(), ForwardContext(None, meta64, torch.empty(0), st64))
    res: dict = {"setting": setting, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu"}
    res["layer_out"] = {
        "fla_vs_fp64": _stats(out, out64),
        "torch_vs_fp64": _stats(ref, out64),
        "fla_vs_torch": _stats(out, ref),
    }
    for name in states:
        res[f"state_{name}"] = {
            "fla_vs_fp64": _stats(states[name], st64[name]),
            "torch_vs_fp64": _stats(ref_states[name], st64[name]),
        }
    res["rows"] = per_rows(out, ref, out64)
    res["conv"] = conv_stage(cap["fla_in"], torch_qkv, qkv64)
    res["rule"] = rule_stage(layer, cap["fla_in"])
    return res


def per_rows(out: torch.Tensor, ref: torch.Tensor, out64: torch.Tensor) -> dict:
    """Largest error of each sequence's rows (decode rows, then each prompt by 64-token chunk)."""
    from splitserve.model.gdn_case import DECODE_ROWS, PROMPT_LENS

    rows = {"decode": slice(0, DECODE_ROWS)}
    start = DECODE_ROWS
    for n in PROMPT_LENS:
        for c0 in range(0, n, 64):
            rows[f"len{n}[{c0}:{min(n, c0 + 64)}]"] = slice(start + c0, start + min(n, c0 + 64))
        start += n
    o64 = out64.double()
    return {
        k: [
            float((out[s].double().cpu() - o64[s]).abs().max()),
            float((ref[s].double().cpu() - o64[s]).abs().max()),
        ]
        for k, s in rows.items()
    }


def conv_stage(fla_in: list, torch_qkv: list, qkv64: list) -> dict:
    """q, k, v out of the conv + SiLU on each path against fp64 (prefill rows)."""
    q, k, v = fla_in[:3]  # the prefill rows
    cat64 = [torch.cat([c[i] for c in qkv64]) for i in range(3)]
    cat_t = [torch.cat([c[i] for c in torch_qkv]) for i in range(3)]
    out = {}
    for i, name in enumerate("qkv"):
        out[name] = {
            "fla_vs_fp64": _stats((q, k, v)[i], cat64[i]),
            "torch_vs_fp64": _stats(cat_t[i], cat64[i]),
        }
    return out


def rule_stage(layer, fla_in: list) -> dict:  # noqa: ANN001
    """The rule alone on the fla path's own inputs (fp32, then rounded to bf16) against fp64."""
    from splitserve.model import gdn_prefill

    q, k, v, a, b, h0, lp = fla_in
    rows = slice(lp.row0, lp.row0 + lp.num_rows)
    q, k, v, a, b = q[None], k[None], v[None], a[None, rows], b[None, rows]
    A_log, dt_bias = layer.A_log.detach(), layer.dt_bias.detach()
    res = {}
    for dt in DTYPES:
        qd, kd, vd, ad, bd = (t.to(dt) for t in (q, k, v, a, b))
        g64 = -A_log.double().cpu().exp() * F.softplus(ad.double().cpu() + dt_bias.double().cpu())
        beta64 = bd.double().cpu().sigmoid()
        o64, f64 = [], []
        bounds = lp.cu_seqlens_cpu.tolist()
        for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            o, f = rule64(qd[0, s:e], kd[0, s:e], vd[0, s:e], g64[0, s:e], beta64[0, s:e], h0[i])
            o64.append(o)
            f64.append(f)
        o64, f64 = torch.cat(o64)[None], torch.stack(f64)
        kw = gdn_prefill.rule_kwargs(lp, h0.clone(), A_log, dt_bias)
        variants = {}
        fwd = gdn_prefill.fla_forward()
        if fwd is not None:
            variants["fla_direct"] = fwd(qd, kd, vd, ad, bd, **kw)
        variants["torch_chunked"] = gdn_prefill.torch_varlen_rule(qd, kd, vd, ad, bd, **kw)
        tag = "fp32" if dt == torch.float32 else "bf16"
        for name, (o, f) in variants.items():
            res[f"{tag}:{name}"] = {
                "out": _stats(o, o64),
                "final": _stats(f, f64),
                "by_pos": by_position(o, o64, bounds),
            }
    return res


def by_position(o: torch.Tensor, o64: torch.Tensor, bounds: list[int]) -> dict:
    """Max error per 16-token span of the 70- and 130-token prompts (chunk edges at 64 and 128)."""
    err = (o[0].double().cpu() - o64[0]).abs().amax(dim=(1, 2))  # [T]
    out = {}
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e - s >= 64:
            out[f"len{e - s}"] = [
                round(float(err[s + p : min(e, s + p + 16)].max()), 7) for p in range(0, e - s, 16)
            ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=tuple(SETTINGS))
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--out", default=None, help="write every setting's JSON here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for each setting's process")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)))
        return 0
    procs = {}
    for s in args.settings:  # in parallel: each compiles its own kernels (most of the time)
        env = {**os.environ, **SETTINGS[s], "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix=f"triton-{s}-")}
        procs[s] = subprocess.Popen(
            [sys.executable, __file__, "--child", s],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = []
    for s, proc in procs.items():
        out, err = proc.communicate(timeout=args.timeout)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"{s}: FAILED rc={proc.returncode}\n{err[-3000:]}")
            continue
        results.append(json.loads(line[0][7:]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        print(f"== {r['setting']} ({r['device']})")
        for key in ("layer_out", "state_conv", "state_recurrent"):
            print(
                f"  {key}: "
                + "; ".join(
                    f"{k} max {v['max_abs']:.2e} rel {v['rel_norm']:.1e} bad {v['bad_frac_2e-4']:.1%}"
                    for k, v in r[key].items()
                )
            )
        for key, v in r["conv"].items():
            print(
                f"  conv {key}: fla max {v['fla_vs_fp64']['max_abs']:.2e}, "
                f"torch max {v['torch_vs_fp64']['max_abs']:.2e}"
            )
        for key, v in r["rule"].items():
            print(
                f"  rule {key}: out max {v['out']['max_abs']:.2e} rel {v['out']['rel_norm']:.1e} "
                f"bad {v['out']['bad_frac_2e-4']:.1%}; final max {v['final']['max_abs']:.2e}; "
                f"by 16-token span {v['by_pos']}"
            )
        print(
            "  rows [fla, torch] max vs fp64: "
            + ", ".join(f"{k} {a:.1e}/{b:.1e}" for k, (a, b) in r["rows"].items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
