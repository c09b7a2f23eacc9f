"""Restart time: cold, warm and cached loads of one checkpoint, each in a fresh process.

Phases (each one a new Python process, so nothing is shared but the OS page cache and the files):

* cold        - the checkpoint's files dropped from the page cache (drop_caches when writable, else
                fsync + posix_fadvise(DONTNEED) per file; the residency left is measured with
                mincore and printed), weight cache off
* warm        - the checkpoint's files read into the page cache first, weight cache off
* build       - warm checkpoint, empty weight cache: the first start that writes the cache entry
* cached      - the entry from `build` (in the page cache): a restart or a second worker
* cached-unverified - (opt-in) the same without the CRC32 checks (what verification costs)
* cached-cold - (opt-in) the entry dropped from the page cache too: a restart after a reboot
* cached-standby - (opt-in) `cached`, in a process started beforehand that has done its imports (and
                made its CUDA context) and waits: how the local runtime restarts a worker (its warm
                spare, `runtime.standby`); "spawn" is then the moment the spare is handed its config

For each: the load itself (`load_model` seconds and weight GB/s, with its stage breakdown) and the
process's time from spawn to ready (interpreter start, imports, CUDA context, load, warm-up); with
`--engine`, also building the engine (KV cache) and serving a first token. Ratios are to `cold`.

Examples:
    python bench/restart.py                                      # default SmolLM2 GGUF, CPU fp32
    python bench/restart.py --model random:qwen3-1.7b-random     # generated bf16 HF checkpoint (3.4 GB)
    python bench/restart.py --model random:qwen3-8b-random --device cuda --workdir /root/rw --engine

`random:SHAPE` writes a random-weight checkpoint of that shape (splitserve.model.random_weights) in
`--workdir` once, as bf16 safetensors shards. Needs torch, safetensors, tqdm (gguf for GGUF models).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a bare checkout, too

PHASES = ("cold", "warm", "build", "cached", "cached-unverified", "cached-cold", "cached-standby")
DEFAULT_PHASES = "cold,warm,build,cached"


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    workdir = Path(args.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    model_path = prepare_model(args.model, workdir, device, args.ckpt_dtype)
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else workdir / "weight-cache"
    files = checkpoint_files(model_path)
    ckpt_bytes = sum(f.stat().st_size for f in files)
    print(f"checkpoint: {model_path} ({len(files)} files, {ckpt_bytes / 1e9:.2f} GB); device {device}")
    print(f"weight cache: {cache_dir}")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    results: list[dict[str, Any]] = []
    for phase in phases:
        page_cache = prepare_phase(phase, files, cache_dir)
        result = run_child(args, phase, model_path, device, cache_dir)
        result["phase"], result["page_cache"] = phase, page_cache
        results.append(result)
        stats = result["load_stats"]
        print(
            f"[{phase}] load {stats['total_seconds']:.2f}s, process ready {result['ready_s']:.2f}s: "
            f"{describe(stats)}",
            flush=True,
        )
    report = {
        "model": str(model_path),
        "model_arg": args.model,
        "device": device,
        "device_name": device_name(device),
        "checkpoint_bytes": ckpt_bytes,
        "threads": args.threads,
        "results": results,
    }
    print()
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.out}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | PATH | random:SHAPE")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--dtype", default="auto", help="auto (fp32 CPU, bf16 CUDA) | float32 | bfloat16 | float16"
    )
    p.add_argument("--ckpt-dtype", default="bfloat16", help="dtype of a generated random checkpoint")
    p.add_argument(
        "--workdir",
        default=str(Path(tempfile.gettempdir()) / "splitserve-restart"),
        help="generated checkpoints and the weight cache (default: TMPDIR/splitserve-restart)",
    )
    p.add_argument("--cache-dir", default=None, help="weight cache directory (default WORKDIR/weight-cache)")
    p.add_argument("--phases", default=DEFAULT_PHASES, help=f"comma-separated, from {', '.join(PHASES)}")
    p.add_argument("--threads", type=int, default=None, help="reader threads (default min(16, cores))")
    p.add_argument("--no-verify", action="store_true", help="skip CRC checks of cache entries")
    p.add_argument("--engine", action="store_true", help="also build the engine and serve one token")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spawned", default=None, help=argparse.SUPPRESS)  # a time, or "standby"
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


# ------------------------------------------------------------------------------------------ model


def prepare_model(spec: str, workdir: Path, device: str, ckpt_dtype: str) -> Path:
    if spec in ("default", "smollm2-135m-instruct"):
        from splitserve.model.checkpoint import default_model_path

        return default_model_path()
    if not spec.startswith("random:"):
        return Path(spec).expanduser().resolve()
    import torch

    from splitserve.model.random_weights import random_model, random_model_config, save_hf_checkpoint

    shape = spec.removeprefix("random:")
    out = workdir / shape
    if (out / "config.json").is_file():
        print(f"using the generated checkpoint {out}")
        return out
    hf_config = random_model_config(shape)
    t = time.perf_counter()
    loaded = random_model(hf_config, device, getattr(torch, ckpt_dtype), max_positions=16)
    tmp = workdir / f".{shape}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(loaded.model, hf_config, tmp)
    del loaded
    for f in tmp.iterdir():  # on disk, so that `cold` can drop it from the page cache
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"generated {out} ({size / 1e9:.2f} GB) in {time.perf_counter() - t:.1f}s")
    return out


def checkpoint_files(path: Path) -> list[Path]:
    from splitserve.model.checkpoint import open_checkpoint

    return [Path(f) for f in open_checkpoint(path).files()]


# ---------------------------------------------------------------------------------- page cache


def prepare_phase(phase: str, files: list[Path], cache_dir: Path) -> dict[str, Any]:
    entries = sorted(cache_dir.glob("*.sswc")) if cache_dir.is_dir() else []
    if phase == "cold":
        how = evict(files)
        return {"checkpoint_resident": resident_fraction(files), "evicted_with": how}
    if phase == "warm":
        preload(files)
        return {"checkpoint_resident": resident_fraction(files)}
    if phase == "build":
        shutil.rmtree(cache_dir, ignore_errors=True)
        preload(files)
        return {"checkpoint_resident": resident_fraction(files)}
    if phase in ("cached", "cached-unverified", "cached-standby"):
        return {"checkpoint_resident": resident_fraction(files), "entry_resident": resident_fraction(entries)}
    if phase == "cached-cold":
        how = evict(entries + files)
        return {
            "checkpoint_resident": resident_fraction(files),
            "entry_resident": resident_fraction(entries),
            "evicted_with": how,
        }
    raise ValueError(phase)


def evict(files: list[Path]) -> str:
    """Drop ``files`` from the page cache: drop_caches when writable, else fsync + fadvise DONTNEED."""
    for f in files:
        with f.open("rb") as fh:
            os.fsync(fh.fileno())  # dirty pages cannot be dropped
    how = "posix_fadvise(DONTNEED)"
    with contextlib.suppress(OSError):
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        how = "drop_caches + posix_fadvise(DONTNEED)"
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return how


def preload(files: list[Path]) -> None:
    buf = bytearray(16 << 20)
    for f in files:
        with f.open("rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def resident_fraction(files: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore), or None where that cannot be read."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        page = mmap.PAGESIZE
        resident = total = 0
        for f in files:
            size = f.stat().st_size
            if size == 0:
                continue
            with f.open("rb") as fh:
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            anchor = ctypes.c_char.from_buffer(mm)
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), size, vec)
            del anchor
            mm.close()
            if rc != 0:
                return None
            resident += sum(1 for v in bytes(vec) if v & 1)
            total += pages
        return round(resident / total, 3) if total else None
    except (OSError, AttributeError, ValueError, TypeError):
        return None


# ------------------------------------------------------------------------------------------ child


def run_child(
    args: argparse.Namespace, phase: str, model: Path, device: str, cache_dir: Path
) -> dict[str, Any]:
    result_file = Path(args.workdir).expanduser() / f".result-{phase}.json"
    result_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        phase,
        "--model",
        str(model),
        "--device",
        device,
        "--dtype",
        args.dtype,
        "--workdir",
        str(args.workdir),
        "--cache-dir",
        str(cache_dir),
        "--result-file",
        str(result_file),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.no_verify:
        cmd.append("--no-verify")
    if args.engine:
        cmd.append("--engine")
    if phase == "cached-standby":  # a warm spare: started and imported before the clock starts
        proc = subprocess.Popen(
            [*cmd, "--spawned", "standby"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "standby":
            raise SystemExit("the standby child did not start")
        spawned = time.time()
        proc.stdin.write(repr(spawned) + "\n")
        proc.stdin.flush()
        if proc.wait() != 0:
            raise SystemExit(f"the standby child failed ({proc.returncode})")
        return json.loads(result_file.read_text())
    spawned = time.time()
    subprocess.run([*cmd, "--spawned", repr(spawned)], check=True)
    return json.loads(result_file.read_text())


def child(args: argparse.Namespace) -> None:
    import logging

    import torch

    from splitserve.config.engine import EngineConfig
    from splitserve.model.loader import load_model
    from splitserve.model.weight_cache import WeightCache

    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s")
    if args.spawned == "standby":  # imports done; a CUDA context too, as the runtime's spare makes one
        if torch.cuda.is_available():
            torch.cuda.init()
        print("standby", flush=True)
        args.spawned = sys.stdin.readline().strip()
    args.spawned = float(args.spawned)
    imported = time.time()
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype)
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    cache = None
    if args.child in ("build", "cached", "cached-unverified", "cached-cold", "cached-standby"):
        verify = not args.no_verify and args.child != "cached-unverified"
        cache = WeightCache(args.cache_dir, None, verify=verify)
    loaded = load_model(
        args.model,
        device,
        dtype,
        config.resolve_max_model_len,
        progress=False,
        weight_cache=cache,
        threads=args.threads,
    )
    ready = time.time()
    out: dict[str, Any] = {
        "load_stats": loaded.load_stats,
        "imports_s": imported - args.spawned,
        "ready_s": ready - args.spawned,
    }
    if args.engine:
        from splitserve.engine.engine import LLMEngine
        from splitserve.sampling.params import SamplingParams

        t = time.perf_counter()
        engine_config = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_bytes=1 << 30,
            progress=False,
            max_model_len=min(4096, loaded.config.max_position_embeddings),
            weight_cache_dir=None,
        )
        engine = LLMEngine(engine_config, tokenizer=False, loaded=loaded)
        engine.add_request(
            list(range(1, 33)), SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        )
        while engine.has_unfinished_requests():
            engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["engine_first_token_s"] = time.perf_counter() - t
        out["first_token_s"] = time.time() - args.spawned
    Path(args.result_file).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------- report


def describe(stats: dict[str, Any]) -> str:
    from splitserve.model.loader import describe_load

    return describe_load(stats)


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def table(report: dict[str, Any]) -> str:
    rows = report["results"]
    cold = next((r for r in rows if r["phase"] == "cold"), rows[0])
    base = cold["load_stats"]["total_seconds"]
    lines = [
        f"{report['model']} on {report['device']} ({report['device_name']}); "
        f"weights {rows[0]['load_stats']['bytes'] / 1e9:.2f} GB "
        f"{rows[0]['load_stats']['dtype']}, checkpoint {report['checkpoint_bytes'] / 1e9:.2f} GB "
        f"{rows[0]['load_stats']['checkpoint_format']}",
        "",
        "| phase | load s | GB/s | speedup vs cold | process ready s | method | cache | page cache "
        "| stages (s) |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- |",
    ]
    for r in rows:
        s = r["load_stats"]
        cache = s.get("cache", {})
        status = cache.get("status", "off") + (" (built)" if cache.get("built") else "")
        pc = r.get("page_cache", {})
        resident = ", ".join(
            f"{k.removesuffix('_resident')} {v:.0%}"
            for k, v in pc.items()
            if k.endswith("resident") and v is not None
        )
        stages = ", ".join(f"{k} {v:.2f}" for k, v in s["seconds"].items())
        ready = f"{r['ready_s']:.2f}"
        if "first_token_s" in r:
            ready += f" (1st token {r['first_token_s']:.2f})"
        lines.append(
            f"| {r['phase']} | {s['total_seconds']:.2f} | {s['gb_per_s']:.2f} | "
            f"{base / s['total_seconds']:.1f}x | {ready} | {s['method']} | {status} | {resident} | {stages} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
