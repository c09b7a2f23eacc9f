"""Build ahead what a first start of a model would otherwise build: run once by scripts/setup.sh.

    python -m splitserve.model.prepare                  # the embedded default model
    python -m splitserve.model.prepare --model PATH     # an HF directory or a GGUF file

Four things, each skipped when already done (a second run takes about as long as the imports):
  1. splitserve's own bytecode (`__pycache__`), which a start would otherwise compile in every process
     it starts (an editable install ships none, and with $PYTHONDONTWRITEBYTECODE set no start writes
     it: each process then compiles what it imports, ~0.1 s of a router's start);
  2. the CPU C++ ops (kernels/cpu/build.py) this host runs, compiled into torch's extensions cache;
  3. the tokenizer: a GGUF vocabulary converted once to a `tokenizer.json` under the cache directory,
     which the router and every worker then load (model/tokenizer.py);
  4. the weight cache entry (model/weight_cache.py) of the model in the dtype a CPU worker loads, and
     on an AVX-512 host the entry of its decode panels beside it (kernels/cpu/panel_cache.py).
A start after it compiles and converts nothing. Prints one line per step, with its seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from splitserve.kernels.cpu.build import CppOps


def compile_bytecode() -> str:
    """splitserve's modules compiled to bytecode where they are imported from (where that folder can be
    written to); -> what was done."""
    import compileall
    import os

    import splitserve

    root = os.path.dirname(splitserve.__file__)
    if not os.access(root, os.W_OK):
        return f"skipped ({root} is read-only)"
    ok = compileall.compile_dir(root, quiet=1, workers=0)
    return f"{root}" if ok else f"{root} (some modules did not compile: see above)"


def cpu_ops() -> list[CppOps]:
    """Every op library this host would load (those switched off, or that the host cannot run, left
    out): the modules that define them, imported."""
    from splitserve.kernels.cpu import (  # noqa: F401 - importing them registers their libraries
        amx,
        attention,
        fused,
        gemm,
        layer,
        prefill,
    )
    from splitserve.kernels.cpu.build import ALL

    return [ops for ops in ALL if ops.enabled]


def missing_ops() -> list[CppOps]:
    """The op libraries of `cpu_ops()` that are not built on this host yet."""
    return [ops for ops in cpu_ops() if not ops.cached()]


def build_ops() -> tuple[list[str], list[str]]:
    """Compile the missing op libraries, in parallel; -> (built, failed) names (a failure is logged:
    the engine then keeps its torch path for that op, as it would at run time)."""
    todo = missing_ops()

    def one(ops: CppOps) -> bool:
        try:
            ops.build(announce=False)
            return True
        except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: reported, not fatal
            logging.getLogger(__name__).warning("%s did not build: %s", ops.what, exc)
            return False

    with ThreadPoolExecutor(max(1, len(todo))) as pool:
        done = list(pool.map(one, todo))
    pairs = list(zip(todo, done, strict=True))
    return [o.name for o, ok in pairs if ok], [o.name for o, ok in pairs if not ok]


def prepare_tokenizer(model: str | None) -> str:
    from splitserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    return "none (the model ships no tokenizer)" if tok is None else f"{tok.vocab_size} tokens"


def prepare_weights(model: str | None) -> str:
    """Load the model once through the weight cache, as a CPU worker does; -> the cache's status."""
    from splitserve.config.engine import EngineConfig
    from splitserve.model.checkpoint import is_random_source
    from splitserve.model.loader import load_model, resolve_model_path

    if is_random_source(model):
        return "skipped (random weights are made at start)"
    config = EngineConfig(model=model, device="cpu", progress=False)
    cache = config.weight_cache()
    if cache is None:
        return "skipped (weight cache off)"
    device = config.torch_device()
    loaded = load_model(resolve_model_path(model), device, config.torch_dtype(device),
                        config.resolve_max_model_len, progress=False, weight_cache=cache)  # fmt: skip
    from splitserve.engine.builder import panel_store
    from splitserve.kernels.cpu import linear as cpu_linear

    store, panels = panel_store(config, loaded), "no decode panels on this host"
    if store is not None:  # as an engine core's build maps them: packed and written here once

        def keep(weights: dict) -> dict | None:
            nonlocal panels
            found = store(weights)
            panels = "decode panels cached" if found else "decode panels not cached (no room)"
            return found

        cpu_linear.prepare_model(loaded.model, config.cpu_weights, defer=True, panel_store=keep)
    return f"{loaded.load_stats['cache']['status']} ({loaded.load_stats['cache'].get('path')}); {panels}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitserve.model.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t = time.perf_counter()
    print(f"prepare: bytecode: {compile_bytecode()} [{time.perf_counter() - t:.1f}s]")
    t0 = time.perf_counter()
    built, failed = build_ops()
    have = [o.name for o in cpu_ops() if o.cached()]
    why = f"; failed: {', '.join(failed)}" if failed else ""
    print(f"prepare: CPU ops: {len(have)} built ({', '.join(built) or 'all were cached'}){why}"
          f" [{time.perf_counter() - t0:.1f}s]")  # fmt: skip
    t1 = time.perf_counter()
    print(f"prepare: tokenizer: {prepare_tokenizer(args.model)} [{time.perf_counter() - t1:.1f}s]")
    t2 = time.perf_counter()
    print(f"prepare: weight cache: {prepare_weights(args.model)} [{time.perf_counter() - t2:.1f}s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
