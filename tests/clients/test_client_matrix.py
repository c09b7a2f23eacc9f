"""The client matrix: the client libraries of a vLLM endpoint's users (openai, langchain-openai,
openai-agents, pydantic-ai, litellm, instructor) against a served deployment of the default model with
an API key. The cases (tests/clients/client_cases.py) run in one process per client library, as a
user's program would, one after another; each case passes or fails on its own outcome, and a case
whose client is not installed skips, naming it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serve_harness import API_KEY, MODEL, manifest_yaml, start_deployment

HERE = Path(__file__).resolve().parent
RESULT = "client-case: "  # client_cases.py's prefix of a case's outcome line
CASES = re.findall(r"^@case\ndef (\w+)\(", (HERE / "client_cases.py").read_text(), flags=re.M)
CASES += [f"instructor_{m}" for m in ("tools", "tools_strict", "json_schema", "responses_tools")]
# a case's prefix -> the module its client installs (the dev extras and scripts/setup.sh install them)
MODULES = {"openai": "openai", "langchain": "langchain_openai", "agents": "agents",
           "pydantic_ai": "pydantic_ai", "litellm": "litellm", "instructor": "instructor"}  # fmt: skip


def _module(case: str) -> str:
    return next(m for prefix, m in MODULES.items() if case.startswith(prefix + "_"))


@pytest.fixture(scope="module")
def served():
    dep = start_deployment(manifest_yaml(mode="colocated", server={"port": 0}), API_KEY)
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)


@pytest.fixture(scope="module")
def library_runs(served):
    """`run(library)` -> {case: its outcome line}: every case of one client library run in one process
    (a user's program that imports the library once), asked the first time one of its cases is."""
    env = {**os.environ, "SS_BASE_URL": f"{served.url}/v1", "SS_API_KEY": API_KEY, "SS_MODEL": MODEL,
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_AGENTS_DISABLE_TRACING": "1"}  # fmt: skip
    done: dict[str, tuple[dict[str, dict], str]] = {}

    def run(library: str) -> tuple[dict[str, dict], str]:
        if library not in done:
            cases = [c for c in CASES if _module(c) == library]
            out = subprocess.run([sys.executable, str(HERE / "client_cases.py"), *cases], env=env,
                                 capture_output=True, text=True, timeout=300 * len(cases))  # fmt: skip
            lines = [json.loads(x[len(RESULT) :]) for x in out.stdout.splitlines() if x.startswith(RESULT)]
            done[library] = {x["case"]: x for x in lines}, out.stdout[-2000:] + out.stderr[-4000:]
        return done[library]

    return run


@pytest.mark.parametrize("case", CASES)
def test_client_case(library_runs, case):
    if importlib.util.find_spec(_module(case)) is None:
        pytest.skip(f"{_module(case)} is not installed")
    outcomes, output = library_runs(_module(case))
    assert case in outcomes, output  # the process ended before this case did
    assert outcomes[case]["ok"], outcomes[case]["error"]
