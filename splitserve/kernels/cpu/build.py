"""Small C++ CPU ops of this package, compiled by the host's C++ compiler on first use.

A `CppOps` is one C++ source that registers ops with `TORCH_LIBRARY`. It is compiled (`$CXX`, else
`c++`) into `$TORCH_EXTENSIONS_DIR/splitserve` (default `~/.cache/torch_extensions/splitserve`), keyed
by the source, the flags and torch's version, so that later starts only load it (well under a second).
An engine calls `start()`: a cached library loads at once; a missing one is compiled in a background
thread once per process, and the engine core waits for it (`wait_started`) before it says it is ready,
so that no request runs, or waits, while the compiler does. `python -m splitserve.model.prepare` (run by
scripts/setup.sh) compiles every op ahead, so that a start compiles nothing. Without a compiler, or
where the build fails, `load()` answers False (the reason logged once) and the torch path stays.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ALL: list[CppOps] = []  # every op library of the package, in the order their modules made them

# shared by the sources: with AVX2 and FMA (`simd_flags`), SS_AVX2 and vector helpers
SIMD_HEADER = r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SS_AVX2 1
#endif

// Cephes' expf: the clamp, log2(e), ln 2 in two parts, the polynomial's coefficients
constexpr float SS_EXP_MIN = -87.3f, SS_EXP_LOG2E = 1.44269504088896341f;
constexpr float SS_EXP_LN2_HI = 0.693359375f, SS_EXP_LN2_LO = -2.12194440e-4f;
constexpr float SS_EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef SS_AVX2
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// exp of x <= 0 (a score minus the row's max): Cephes' expf (range reduction by ln 2 in two parts, a
// degree-5 polynomial), about 1 ulp; inputs below -87.3 give ~1e-38 instead of a smaller number or 0.
// Its constants serve every width (AVX512_HEADER's exp16 is the same steps on 16 lanes).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(SS_EXP_MIN));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(SS_EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(SS_EXP_LN2_HI), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(SS_EXP_LN2_LO), x);
  __m256 y = _mm256_set1_ps(SS_EXP_P[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(SS_EXP_P[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

"""


# for sources built with -mavx512f (after SIMD_HEADER, whose constants it uses): exp8 on 16 lanes
AVX512_HEADER = r"""
#include <immintrin.h>
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(SS_EXP_MIN));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(SS_EXP_LOG2E)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(SS_EXP_LN2_HI), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(SS_EXP_LN2_LO), x);
  __m512 y = _mm512_set1_ps(SS_EXP_P[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(SS_EXP_P[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
"""


def simd_flags() -> list[str]:
    """-O3, plus AVX2 and FMA where torch's own CPU capability says the host has them."""
    flags = ["-O3", "-fno-math-errno"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


class CppOps:
    """One C++ source of ops (`namespace`::op names), built once per host and loaded once per process.

    `enabled`: False keeps the ops off (`load(force=True)` builds them anyway, for tests and benches);
    `what`: how a failure to build reads in the log."""

    def __init__(self, name: str, source: str, flags: list[str], enabled: bool, what: str) -> None:
        self.name, self.source, self.enabled, self.what = name, source, enabled, what
        # -fopenmp: at::parallel_for is inline (ATen/ParallelOpenMP.h); without it the ops run on one
        # thread. The library then needs libgomp.so.1, which the process already has loaded from torch.
        self.flags = [*flags, "-std=c++20", "-fPIC", "-shared", "-DNDEBUG", "-fopenmp"]
        self.flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
        self.loaded: bool | None = None  # None: not tried yet in this process
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        ALL.append(self)

    def cached(self) -> bool:
        """Whether the library for this source, these flags and this torch is built on this host."""
        return self.path().exists()

    def load(self, force: bool = False) -> bool:
        """Build (or find) and load the library, once per process; False where it is off (unless
        `force`) or cannot be built (the reason is logged once)."""
        with self._lock:
            if self.loaded is not None:
                return self.loaded
            if not (self.enabled or force):
                return False
            try:
                torch.ops.load_library(str(self.build()))
                self.loaded = True
            except Exception as e:  # no compiler, a failed build: keep the torch path
                log.warning("%s unavailable (%s); the torch path stays", self.what, e)
                self.loaded = False
            return self.loaded

    def path(self) -> Path:
        """Where the library is cached: keyed by this source, these flags and this torch."""
        key = hashlib.sha256("\0".join([self.source, *self.flags, torch.__version__]).encode()).hexdigest()
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
        return root / "splitserve" / f"{self.name}_{key[:16]}.so"

    def build(self, announce: bool = True) -> Path:
        """The shared library: from the cache when this source, these flags and this torch built it
        before, else compiled into a temporary name and renamed into place, so that concurrent builders
        (two workers) and a build killed half way leave no lock and no partial file behind."""
        lib = self.path()
        if lib.exists():
            return lib
        from torch.utils import cpp_extension  # only to compile (it imports setuptools: 0.06 s)

        lib.parent.mkdir(parents=True, exist_ok=True)
        if announce:  # at run time: a start that compiles is one that setup did not prepare
            log.warning("compiling %s (%s); `python -m splitserve.model.prepare` builds it ahead",
                        self.what, lib.name)  # fmt: skip
        libdirs = cpp_extension.library_paths()
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            src, out = Path(tmp) / "op.cpp", Path(tmp) / "op.so"
            src.write_text(self.source)
            cmd = [os.environ.get("CXX", "c++"), *self.flags]
            cmd += [f"-isystem{p}" for p in cpp_extension.include_paths()]
            cmd += [str(src), "-o", str(out), *[f"-L{d}" for d in libdirs], "-lc10", "-ltorch_cpu"]
            cmd += [f"-Wl,-rpath,{d}" for d in libdirs]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"{cmd[0]} failed: {done.stderr.strip()[-2000:]}")
            os.replace(out, lib)
        return lib

    def start(self) -> bool:
        """For an engine: True where the ops are on; then they are loaded now when the cache has them,
        else built in a background thread, once per process (the engine runs its torch path until
        `ready()`): a first start on a host does not wait for the compiler."""
        if not self.enabled:
            return False
        if self.loaded is None and self.thread is None and self.path().exists():
            self.load()
        with self._start_lock:  # not `_lock`, which the build holds
            if self.loaded is None and self.thread is None:
                self.thread = threading.Thread(target=self.load, name=f"{self.name}-build", daemon=True)
                self.thread.start()
        return True

    def ready(self) -> bool:
        """Whether the library is built and loaded in this process."""
        return self.loaded is True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until a build that `start()` began has ended (loaded or failed); -> `ready()`."""
        if self.thread is not None:
            self.thread.join(timeout_s)
        return self.ready()


def load_cached() -> list[str]:
    """Load every switched-on op library of the modules imported so far that is already built (none is
    compiled); -> their names. The engine-core fork server (core/zygote.py) does this once, so that the
    cores it forks find them loaded."""
    return [ops.name for ops in ALL if ops.enabled and ops.loaded is None and ops.cached() and ops.load()]


def wait_started(timeout_s: float = 900.0) -> list[str]:
    """Until every op library an engine started (`start()`) is built and loaded, or has failed; -> the
    names of those that were not already loaded when called (built now, or failed)."""
    waited = [ops for ops in ALL if ops.thread is not None and ops.thread.is_alive()]
    for ops in waited:
        ops.wait(timeout_s)
    return [ops.name for ops in waited]
