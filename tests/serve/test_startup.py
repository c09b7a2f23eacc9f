"""A deployment's start: after `python -m splitserve.model.prepare` (what scripts/setup.sh runs) nothing is
left to compile or convert, and a served start logs no build."""

from __future__ import annotations

import subprocess
import sys

import pytest
from serve_harness import manifest_yaml, start_deployment

from splitserve.model.prepare import cpu_ops, missing_ops

pytestmark = pytest.mark.slow


def _prepare() -> str:
    run = subprocess.run([sys.executable, "-m", "splitserve.model.prepare"], capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_after_prepare_the_build_cache_is_complete_and_a_start_compiles_nothing() -> None:
    _prepare()
    again = _prepare()  # idempotent: the second run finds everything built
    assert "all were cached" in again and "weight cache: hit" in again, again
    assert cpu_ops(), "this host runs at least the portable CPU ops"
    assert missing_ops() == [], [o.name for o in missing_ops()]
    assert all(o.cached() for o in cpu_ops())
    dep = start_deployment(manifest_yaml(mode="colocated"))
    try:
        r = dep.client().completions.create(model="smollm2-135m-instruct", prompt="Hi", max_tokens=2)
        assert r.choices[0].text is not None
        built = [line for line in dep.log if "compiling" in line or "compiled at start" in line]
        assert not built, "\n".join(dep.log)
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
