"""CPU projections: fp32 through oneDNN with weights packed once, or weight-only int4 (an option).

**fp32 (the default).** On this repo's CPU machines (AMD EPYC, AVX-512) `F.linear` goes to MKL, which
runs its AVX2 kernels on AMD processors and reads a cold fp32 weight at about half the memory bandwidth
at batch 1, and far below it at batch 4-32 (`bench/cpu_engine.py` prints both). oneDNN's matmul over a
weight reordered into its blocked layout (what vLLM-CPU does) uses AVX-512 on any vendor: the decode
step's projections and the LM head run about 2x faster at batch 1 and 2.5x at batch 32, prefill's about
2x. oneDNN sums in another order than MKL: logits differ from `F.linear`'s by ~1e-5 relative, and
greedy output stays token-exact with HF on the parity tests (`tests/engine/test_hf_parity.py`).

**int4 (`cpu_weights="int4"`, off by default).** Each projection weight is kept as 4-bit codes with a
scale and an offset per group of 32 inputs (asymmetric: w = d * q + m, q in 0..15), multiplied by
torch's `_weight_int4pack_mm_for_cpu`; the LM head as int8 with one scale per row, multiplied by
`_weight_int8pack_mm`; activations enter both in bf16, the residual stream stays fp32. The codes are
taken from the weights in memory: a Q4_1 GGUF (the embedded default) was dequantized from exactly this
form, so its own codes come back (`int4_codes` returns the largest reconstruction error, ~0 for
them); the scales are rounded to bf16 (the kernels want the activations' dtype). Its top-1
agreement with the fp32 path is measured by `bench/cpu_quant.py`.
Products of `INT4_BF16_ROWS` rows or more (prompt steps, larger decode batches) do not take the int4
kernels: the same dequantized weights, rounded to bf16 and packed for oneDNN's bf16 matmul, run at ~2x
fp32's rate there, while torch's int4 kernel runs at about two thirds of it (the 30 layers' products
of a 256-token prompt: 193 ms bf16, 364 fp32, 566 int4). Below that the int4 codes win: a decode step
reads a quarter of bf16's bytes (decode steps of the default model, on the 2-vCPU Zen 4 box: 8 rows
26.8 ms int4 against 29.8 bf16, 12 rows 41.3 against 37.4, 16 rows 58.4 against 39.9;
docs/bench/cpu-engine.md). So the int4 option keeps both, counted for the default model:
the codes with their scales (~66 MB) and the int8 head (~28 MB) beside the bf16 weights with the head
(~270 MB), ~365 MB against fp32's ~1.08 GB in two layouts (oneDNN's and the panels').
`SPLITSERVE_CPU_INT4_BF16_ROWS` sets the row count (default 10; a large one keeps the int4 kernels).

`prepare_model` keeps the module's dense fp32 weight beside the packed one (`Linear.cpu_matmul`,
`DecoderLM.cpu_lm_head` are callables), so that a model shared with other readers (tests, benches,
HF exports) still sees them. An engine that loaded its model itself (a served worker) then calls
`drop_dense`: the projections' dense weights become meta tensors (nothing reads them any more) and the
rest are copied out of the load's flat buffer / weight-cache mapping, which is thereby released: one
copy of the projections (~430 MB for the default model) less per worker; the tied embedding stays.
Where one- and two-row products read the dense weights through MKL (`gemv_dense`, Intel processors
without AVX-512 panels) nothing is dropped: they stay where the load put them (the weight cache's
mapping, shared by workers).

**Decode batches on AVX-512 hosts.** 1 to `cpu_gemm.MAX_ROWS` rows go to kernels/cpu/gemm.py's op over a
third layout of the weight (panels of 32 outputs), oneDNN above; MKL's GEMV is not needed, so the dense
weights are dropped. Memory: packed here, the panels are the worker's own (~540 MB for the default model,
measured `Pss_Anon` of a served core 2.18 GB against 1.62 GB + 0.56 GB of the shared weight-cache file
before); an engine that loads through the weight cache maps them from it instead (kernels/cpu/panel_cache.py),
shared with every core on the host.
The panels are a second private copy beside oneDNN's, so `prepare_model` builds them only where they
take at most `PANELS_MEMORY_SHARE` of the host's available memory (`MemAvailable`) at load: a large
fp32 model on a small host keeps one layout (oneDNN, and MKL's GEMV on Intel) instead of running out of
memory; the log says so.
`SPLITSERVE_CPU_ONEDNN=0` leaves fp32 projections on `F.linear` (an A/B switch).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels.cpu import amx as cpu_amx
from splitserve.kernels.cpu import gemm as cpu_gemm

log = logging.getLogger(__name__)

ENABLED = os.environ.get("SPLITSERVE_CPU_ONEDNN", "1") != "0"
DROP_DENSE = os.environ.get("SPLITSERVE_CPU_KEEP_DENSE", "0") != "1"  # 1: keep them (an A/B switch)
CPU_WEIGHTS = ("fp32", "int4")
GROUP = 32  # int4: inputs per scale/offset pair (Q4_0/Q4_1's block)
INT4_BF16_ROWS = int(os.environ.get("SPLITSERVE_CPU_INT4_BF16_ROWS", "10"))  # int4 option: bf16 from here
GEMV_ROWS = 2  # fp32 with the dense weights kept: up to this many rows through F.linear (MKL)
PANELS_MEMORY_SHARE = 0.25  # the panels' most bytes, as a share of the host's available memory
# an engine core sets it: engines that loaded their own weights defer oneDNN's layouts (prepare_model)
DEFER_ONEDNN = False
_PACKING = threading.Lock()  # deferred oneDNN layouts (OneDNNMatmul.pack_now)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense -> the same weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, bias) with W packed by `pack`. x [..., in] -> [..., out]."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


class OneDNNMatmul:
    """x @ W.T + b through the packed weight; with `amx` (a block-quantized weight on an AMX host)
    products of cpu_amx.MIN_ROWS rows or more (the LM head's: HEAD_MIN_ROWS) go to kernels/cpu/amx.py's
    op; with `panels` (AVX-512 hosts) 1 to cpu_gemm.MAX_ROWS rows go to kernels/cpu/gemm.py's op; else
    with `dense` (the weight itself) kept, one or two rows go to `F.linear` (MKL's GEMV, faster than
    oneDNN there on Intel: `gemv_dense()`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dense: bool = False,
                 panels: bool | torch.Tensor = False, amx: bool = False, head: bool = False,
                 defer: bool = False) -> None:  # fmt: skip
        self.head = head  # the LM head: kernels/cpu/amx.py's op from fewer rows
        # `panels`: True packs them here; a tensor is them, packed already (kernels/cpu/panel_cache.py)
        made = isinstance(panels, torch.Tensor)
        self.panels = panels if made else cpu_gemm.pack(weight) if panels else None
        # `defer` (with panels): oneDNN's layout on first use or by `pack_deferred`, not now
        self.bias, self._unpacked = bias, weight if defer and self.panels is not None else None
        self.packed: torch.Tensor | None = pack(weight) if self._unpacked is None else None
        self.amx = cpu_amx.blocks(weight) if amx else None
        self.n = weight.shape[0]
        self.dense = weight if dense and self.panels is None else None

    def takes_amx(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs on kernels/cpu/amx.py's op now."""
        least = cpu_amx.HEAD_MIN_ROWS if self.head else cpu_amx.MIN_ROWS
        return self.amx is not None and rows >= least and cpu_amx.ready()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.takes_amx(rows):
            return cpu_amx.matmul(x, self.amx, self.bias)
        if self.panels is not None and rows <= cpu_gemm.MAX_ROWS and cpu_gemm.ready():
            return cpu_gemm.matmul(x, self.panels, self.n, self.bias)
        if self.dense is not None and rows <= GEMV_ROWS:
            return F.linear(x, self.dense, self.bias)
        return packed_linear(x, self.packed if self.packed is not None else self.pack_now(), self.bias)

    def pack_now(self) -> torch.Tensor:
        """oneDNN's layout of a deferred weight, made once (whichever thread comes first)."""
        with _PACKING:
            if self.packed is None:
                assert self._unpacked is not None
                self.packed, self._unpacked = pack(self._unpacked), None
            return self.packed


def gemv_dense() -> bool:
    """Whether decode rows of one or two tokens should read the dense weight through MKL: on Intel
    processors, where MKL runs its AVX-512 kernels (on AMD it takes its AVX2 path, slower than oneDNN).
    Measured on a 2-vCPU Xeon with AVX-512 and AMX (`bench/cpu_engine.py`'s batch-1 row, and all 30
    layers' projections of the default model alone): MKL 16-19 ms against oneDNN 20-22 ms at one row,
    18 against 21 at two; oneDNN ahead from 4 rows (22 against 29) to 32. The dense weights then stay
    beside the packed ones (+430 MB for the default model). `SPLITSERVE_CPU_GEMV=0|1` overrides."""
    forced = os.environ.get("SPLITSERVE_CPU_GEMV")
    if forced in ("0", "1"):
        return forced == "1"
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            vendors = {line.split(":")[-1].strip() for line in f if line.startswith("vendor_id")}
        return vendors == {"GenuineIntel"}
    except OSError:
        return False


def available_memory() -> int | None:
    """The host's `MemAvailable` in bytes (None where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def panels_fit(nbytes: int) -> bool:
    """Whether `nbytes` of panels fit in `PANELS_MEMORY_SHARE` of the available memory (True where
    that is unknown)."""
    avail = available_memory()
    if avail is None or nbytes <= PANELS_MEMORY_SHARE * avail:
        return True
    log.warning("CPU: no decode panels (kernels/cpu/gemm.py) for this model: they would take %.1f GB, more "
                "than %.0f%% of the %.1f GB available; projections stay on oneDNN", nbytes / 1e9,
                100 * PANELS_MEMORY_SHARE, avail / 1e9)  # fmt: skip
    return False


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """[N, K] fp32 (K a multiple of GROUP) -> (codes [N, K / GROUP, GROUP] fp32 in 0..15, scales_and_zeros
    [K / GROUP, N, 2] fp32 as `_weight_int4pack_mm_for_cpu` takes them, the largest |w - dequantized|)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)  # [N, K / GROUP]
    d = (hi - lo) / 15
    d = torch.where(d > 0, d, torch.ones_like(d))  # a constant group: q = 0, w = lo
    q = torch.round((w - lo[..., None]) / d[..., None]).clamp_(0, 15)
    err = float((q * d[..., None] + lo[..., None] - w).abs().max())
    # the kernel's dequantization: (q - 8) * scale + zero, so zero = lo + 8 d
    scales_zeros = torch.stack([d, lo + 8 * d], dim=-1).transpose(0, 1).contiguous()
    return q, scales_zeros, err


def _bf16_rows(x: torch.Tensor) -> bool:
    return x.numel() // x.shape[-1] >= INT4_BF16_ROWS


class Int4Matmul:
    """x @ W.T + b with W as int4 codes per group of 32 inputs; bf16 activations, fp32 out. From
    `INT4_BF16_ROWS` rows: the same weights dequantized to bf16, through oneDNN."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, sz, self.err = int4_codes(weight)
        n, k = weight.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k).to(torch.int32), 2)
        self.scales_zeros = sz.to(torch.bfloat16)
        scale, zero = self.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, K / GROUP] each
        dense = (q - 8) * scale[..., None] + zero[..., None]  # what the int4 kernel multiplies by
        self.bf16 = pack(dense.view(n, k).to(torch.bfloat16))
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if _bf16_rows(flat):
            out = packed_linear(flat, self.bf16, None).float()
        else:
            int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
            out = int4_mm(flat, self.packed, GROUP, self.scales_zeros).float()
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


class Int8Matmul:
    """x @ W.T with W as int8 and one scale per row (the LM head); bf16 activations, fp32 out. From
    `INT4_BF16_ROWS` rows: the same weights as bf16, through oneDNN."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        scale = w.abs().amax(-1).clamp_min(1e-12) / 127  # [N]
        self.codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.scales = scale.to(torch.bfloat16)
        self.bf16 = pack((self.codes.float() * self.scales.float()[:, None]).to(torch.bfloat16))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _bf16_rows(x):
            return packed_linear(x.to(torch.bfloat16), self.bf16, None).float()
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales).float()


PanelStore = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]


def prepare_model(
    model: nn.Module, cpu_weights: str = "fp32", defer: bool = False, panel_store: PanelStore | None = None
) -> dict[str, int]:
    """Give every `Linear` of a CPU fp32 model (and a decoder's LM head) its `cpu_matmul`; -> counts by
    kind. `cpu_weights`: "fp32" (oneDNN, unless SPLITSERVE_CPU_ONEDNN=0) or "int4". `defer`: where the
    panels take 1 to cpu_gemm.MAX_ROWS rows, oneDNN's layout (for longer products: prompts past 128
    tokens) is made on first use or by `pack_deferred`, not now: about half of a start's CPU time on
    the weights, which a served engine spends once it is ready. `panel_store`: given {name: weight}
    of the projections that take panels, their panels made elsewhere (kernels/cpu/panel_cache.py: mapped
    from the weight cache) or None (then they are packed here)."""
    from splitserve.model.layers import Linear

    if cpu_weights not in CPU_WEIGHTS:
        raise ValueError(f"cpu_weights must be one of {CPU_WEIGHTS}, not {cpu_weights!r}")
    unprepare_model(model)
    counts: dict[str, int] = {}
    int4 = cpu_weights == "int4"

    def usable(w: torch.Tensor) -> bool:
        return w.device.type == "cpu" and w.dtype == torch.float32 and (ENABLED or int4)

    head = _lm_head_weight(model)
    weights = [m.weight for m in model.modules() if isinstance(m, Linear) and usable(m.weight)]
    weights += [head] if head is not None and usable(head) else []
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    # AVX-512: small batches through cpu_gemm (no dense kept), where a second copy fits in memory
    panels = not int4 and bool(weights) and panels_fit(nbytes) and cpu_gemm.start()
    dense = not int4 and not panels and gemv_dense()
    fp32 = "onednn + panels" if panels else "onednn + MKL gemv" if dense else "onednn"
    # AMX hosts: block-quantized weights' codes as bf16 (half the fp32 bytes) for larger products
    amx = not int4 and bool(weights) and cpu_amx.ENABLED and cpu_amx.supported() and panels_fit(nbytes // 2)
    amx = amx and cpu_amx.start()

    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear) and usable(m.weight)}
    made = None
    if panels and panel_store is not None:
        named = {name: m.weight for name, m in linears.items()}
        made = panel_store(named | ({"lm_head": head} if head is not None and usable(head) else {}))
    made = made or {}
    for name, module in linears.items():
        quant = int4 and module.weight.shape[1] % GROUP == 0
        if quant:
            module.cpu_matmul = Int4Matmul(module.weight, module.bias)
        else:
            got = made.get(name, panels)
            module.cpu_matmul = OneDNNMatmul(module.weight, module.bias, dense, got, amx, defer=defer)
        kind = "int4" if quant else fp32 + (" + amx" if module.cpu_matmul.amx is not None else "")
        counts[kind] = counts.get(kind, 0) + 1
    if head is not None and usable(head):
        got = made.get("lm_head", panels)
        fp32_head = OneDNNMatmul(head, None, dense, got, amx, True, defer) if not int4 else None
        model.cpu_lm_head = Int8Matmul(head) if int4 else fp32_head
        on_amx = not int4 and model.cpu_lm_head.amx is not None
        counts["lm_head int8" if int4 else f"lm_head {fp32}" + (" + amx" if on_amx else "")] = 1
    return counts


def pack_deferred(model: nn.Module) -> int:
    """Make every oneDNN layout `prepare_model(defer=True)` left for later; -> how many were left."""
    mats = [getattr(m, "cpu_matmul", None) for m in model.modules()] + [getattr(model, "cpu_lm_head", None)]
    left = [m for m in mats if isinstance(m, OneDNNMatmul) and m.packed is None]
    for m in left:
        m.pack_now()
    return len(left)


def drop_dense(model: nn.Module) -> int:
    """After `prepare_model`, for a model nobody else reads: each projection with a `cpu_matmul` loses
    its dense weight (a meta tensor of the same shape, so a stray read fails loudly) and every other
    parameter gets its own storage (the load's flat buffer or the weight cache's mapping, which they
    and the dropped weights viewed, is then freed). -> bytes of dense weights dropped."""
    from splitserve.model.layers import Linear

    dropped = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.cpu_matmul is not None:
            if getattr(module.cpu_matmul, "dense", None) is not None:
                continue  # still read (a one- or two-row decode's GEMV)
            w = module.weight
            dropped += w.numel() * w.element_size()
            meta = torch.empty(w.shape, dtype=w.dtype, device="meta")
            module.weight = nn.Parameter(meta, requires_grad=False)
    if not dropped:  # nothing dropped (all kept for the GEMV): the weights stay where the load put them
        return 0
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if param.device.type == "cpu":
                    module._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=False)
            matmul = getattr(module, "cpu_matmul", None)
            if matmul is not None and getattr(matmul, "bias", None) is not None:
                matmul.bias = module.bias  # the copy, not the old view
    model._cpu_dense_dropped = True
    return dropped


def unprepare_model(model: nn.Module) -> None:
    """Back to `F.linear` everywhere (the benches' A/B in one process)."""
    if getattr(model, "_cpu_dense_dropped", False):
        raise RuntimeError("the dense weights were dropped (drop_dense): F.linear has nothing to read")
    for module in model.modules():
        if getattr(module, "cpu_matmul", None) is not None:
            module.cpu_matmul = None
    if getattr(model, "cpu_lm_head", None) is not None:
        model.cpu_lm_head = None


def _lm_head_weight(model: nn.Module) -> torch.Tensor | None:
    if not hasattr(model, "cpu_lm_head"):
        return None  # a model whose compute_logits does not read a CPU head
    lm_head = getattr(model, "lm_head", None)
    return model.embed_tokens.weight if lm_head is None else lm_head.weight
