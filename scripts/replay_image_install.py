"""Replays deploy/docker/Dockerfile's NIXL install in a clean virtual environment (images cannot be built
here): pip installs the pinned nixl-cu12 (without its torch dependency, which the image takes from the
CUDA index) and numpy, imports nixl_cu12, finds the wheel's LIBFABRIC plugin, and checks that every
library the plugin links resolves on this system, libfabric.so.1 and libhwloc.so.15 among them (the
packages the Dockerfile installs: libfabric1, libhwloc15). Exit 0 when all hold.

    python scripts/replay_image_install.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep", default=None, help="build the venv here and keep it")
    args = p.parse_args()
    version = re.search(r"^ARG NIXL_VERSION=(\S+)$", DOCKERFILE.read_text(), flags=re.M).group(1)
    where = Path(args.keep or tempfile.mkdtemp(prefix="splitserve-image-"))
    venv.create(where, with_pip=True)
    py = where / "bin" / "python"
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", f"nixl-cu12=={version}", "numpy"], check=True
    )
    probe = "import nixl_cu12, pathlib; print(pathlib.Path(nixl_cu12.__file__).parent)"
    out = subprocess.run([py, "-c", probe],
                         capture_output=True, text=True, check=True)  # fmt: skip
    site = Path(out.stdout.strip()).parent
    plugins = sorted(site.glob("**/libplugin_LIBFABRIC.so"))
    print(f"nixl-cu12 {version}: imported from {site}; LIBFABRIC plugins: {[str(x) for x in plugins]}")
    if not plugins:
        print("FAIL: no libplugin_LIBFABRIC.so in the wheel")
        return 1
    missing = set()
    # the wheel's own libraries (libnixl_common.so, ...) are loaded by NIXL before its plugins
    own = ":".join(str(d) for d in sorted({x.parent for x in site.glob("*nixl_cu12*libs/**/*.so*")}))
    for plugin in plugins:
        env = {**os.environ, "LD_LIBRARY_PATH": own}
        ldd = subprocess.run(
            ["ldd", str(plugin)], capture_output=True, text=True, check=False, env=env
        ).stdout
        for lib in re.findall(r"^\s*(\S+) => not found", ldd, flags=re.M):
            missing.add(lib)
        for lib in ("libfabric.so.1", "libhwloc.so.15"):
            found = re.search(rf"{re.escape(lib)} => (\S+)", ldd)
            print(f"  {plugin.name}: {lib} -> {found.group(1) if found else 'not found'}")
    # the CUDA driver and runtime come with the GPU node and torch's CUDA wheels, not from this replay
    missing -= {"libcuda.so.1", "libcudart.so.12"}
    if missing:
        print(f"FAIL: unresolved: {sorted(missing)}")
        return 1
    print("OK: the plugin's system libraries resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
