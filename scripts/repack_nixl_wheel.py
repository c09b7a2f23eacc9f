"""Repack the nixl-cu12 wheel without what splitserve's nixl transport never loads, so that it fits a
64 MiB device upload (the wheel is 68.6 MB):

  nixl_ep_cu12/            NIXL-EP, the expert-parallel all-to-all extension (three torch builds)
  storage and DOCA plugins AZURE_BLOB, GDS, GDS_MT, GPUNETIO, GUSLI, INFINIA, OBJ, POSIX (both copies)
  UCX perftest modules     libucx_perftest_*
  then every bundled library no longer needed by what stays (NEEDED closure of the kept ELF files;
  the plugins and UCX's transport modules are kept as roots: they are loaded by path)

Kept: the Python API, libnixl*, the UCX and LIBFABRIC plugins, telemetry exporters, UCX. RECORD is
rewritten for the files that stay.

    python scripts/repack_nixl_wheel.py nixl_cu12-1.5.1-...whl .nixlwheel/
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DROP_PLUGINS = ("AZURE_BLOB", "GDS", "GDS_MT", "GPUNETIO", "GUSLI", "INFINIA", "OBJ", "POSIX")
DROP = [re.compile(p) for p in (
    r"^nixl_ep_cu12/",
    rf"plugins/libplugin_({'|'.join(DROP_PLUGINS)})\.so$",
    rf"nixl_cu12\.libs/nixl/libplugin_({'|'.join(DROP_PLUGINS)})\.so$",
    r"libucx_perftest_",
)]  # fmt: skip


def needed(path: Path) -> set[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out))


def main(wheel: str, out_dir: str) -> None:
    src = zipfile.ZipFile(wheel)
    names = [n for n in src.namelist() if not any(p.search(n) for p in DROP)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src.extractall(root, [n for n in names if ".so" in n])
        # libraries linked by name (directly in nixl_cu12.libs/); plugins and UCX modules are loaded
        # by path, so they are roots, never dropped here
        bundled = {Path(n).name: n for n in names if n.startswith("nixl_cu12.libs/") and n.count("/") == 1}
        keep_libs: set[str] = set()
        todo = [n for n in names if ".so" in n and n not in bundled.values()]
        while todo:
            for lib in needed(root / todo.pop()):
                if lib in bundled and lib not in keep_libs:
                    keep_libs.add(lib)
                    todo.append(bundled[lib])
        unused = {n for lib, n in bundled.items() if ".so" in lib and lib not in keep_libs}
        names = [n for n in names if n not in unused]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    target = Path(out_dir) / Path(wheel).name
    target.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for name in names:
            if name == record:
                continue
            data = src.read(name)
            dst.writestr(src.getinfo(name), data, zipfile.ZIP_DEFLATED, 9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
        dst.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
    dropped = sorted(set(src.namelist()) - set(names))
    print(f"{target}: {target.stat().st_size / 1e6:.1f} MB (from {Path(wheel).stat().st_size / 1e6:.1f} MB), "
          f"{len(dropped)} files dropped:")  # fmt: skip
    for name in dropped:
        print(f"  - {name}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
