"""deploy/docker/Dockerfile: every path it copies exists, every module its check imports is one of
ours (or nixl_cu12, the wheel it installs), the versions are pinned, and it ends as a non-root user.
With hadolint installed, the linter passes it too."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def test_paths_modules_pins_and_user():
    text = DOCKERFILE.read_text()
    for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, flags=re.M):
        for path in line.split():
            assert (ROOT / path).exists(), path
    imported = re.search(r'python -c "import ([^"]+)"', text).group(1)
    for module in (m.strip() for m in imported.split(",")):
        if module != "nixl_cu12":  # installed by the image, not here
            assert importlib.util.find_spec(module) is not None, module
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, flags=re.M)
    assert re.search(r"^ARG NIXL_VERSION=\d+\.\d+\.\d+$", text, flags=re.M)
    assert "libfabric1" in text
    users = re.findall(r"^USER (\S+)$", text, flags=re.M)
    assert users and users[-1] == "1000:100"


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed")
def test_hadolint_passes():
    out = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
