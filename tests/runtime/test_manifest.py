"""The manifest: defaults, the shipped examples, errors that name the YAML path and line, CLI overrides."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from splitserve.config import ManifestError, dump_manifest, load_manifest, parse_manifest
from splitserve.runtime.local import worker_argv

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_defaults_serve_the_default_model_disaggregated():
    m = load_manifest()
    assert m.mode == "disaggregated" and m.model.source == "default"
    assert m.model.resolved_served_name() == "smollm2-135m-instruct"
    assert set(m.pools()) == {"prefill", "decode"}
    assert m.transport.required() == [m.transport.backend]


def test_examples_load_and_differ_only_in_mode():
    dis = load_manifest(EXAMPLES / "disaggregated.yaml")
    col = load_manifest(EXAMPLES / "colocated.yaml")
    assert (dis.mode, col.mode) == ("disaggregated", "colocated")
    assert dis.model_dump(exclude={"mode"}) == col.model_dump(exclude={"mode"})
    assert set(col.pools()) == {"colocated"}


def test_one_key_switches_mode():
    text = (EXAMPLES / "disaggregated.yaml").read_text()
    m = parse_manifest(text, overrides={"mode": "colocated"})
    assert m.mode == "colocated" and set(m.pools()) == {"colocated"}


def test_errors_name_path_line_and_fix():
    text = """\
mode: colo
transport:
  backend: shm
  fallbak: [tcp]
router:
  timeouts:
    prefill_s: -1
server: {port: 99999}
engine:
  kv_cache_mb: 64
  memory_utilization: 0.5
"""
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, "bad.yaml")
    problems = info.value.problems
    msg = str(info.value)
    assert "bad.yaml" in msg
    assert any("mode (line 1): must be 'colocated' or 'disaggregated'" in p for p in problems)
    assert any("transport.fallbak (line 4): unknown field; did you mean 'fallback'?" in p for p in problems)
    assert any(p.startswith("router.timeouts.prefill_s (line 7)") and "greater than 0" in p for p in problems)
    assert any(p.startswith("server.port (line 8)") for p in problems)
    assert any(p.startswith("engine (line 10)") and "not both" in p for p in problems)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("transport: {backend: rdma}", "transport.backend"),
        ("transport: {backend: tcp, fallback: [tcp]}", "only alternatives"),
        ("mode: disaggregated\ndecode: {replicas: 0}", "decode.replicas >= 1"),
        ("[1, 2]", "mapping"),
        ("model: {source: x\n", "not valid YAML"),
        ("modell: {}", "did you mean 'model'"),
    ],
)
def test_more_errors(text, words):
    with pytest.raises(ManifestError, match=words.replace("[", r"\[").replace(".", r"\.")):
        parse_manifest(text)


def _worker(argv: list[str], env: str = "S"):
    """The WorkerConfig a worker process builds from `argv` (as worker.main does)."""
    import os

    from splitserve.worker.cli import build_parser, config_from_args

    os.environ[env] = "a-secret"
    try:
        return config_from_args(build_parser().parse_args(argv[3:]))
    finally:
        del os.environ[env]


def test_worker_command_lines_follow_the_manifest():
    m = parse_manifest(
        "transport: {backend: tcp, fallback: [shm], policy: recompute, checksum: crc32}\n"
        "prefill: {replicas: 2, devices: ['cuda:0', 'cuda:1']}\nengine: {kv_cache_mb: 99}"
    )
    argv = worker_argv(m, "prefill", 1, "SECRET_ENV")
    assert argv[argv.index("--kv-secret-env") + 1] == "SECRET_ENV"
    assert "a-secret" not in " ".join(argv) and '"kv_secret": null' in argv[argv.index("--spec") + 1]
    w = _worker(argv, "SECRET_ENV")
    assert (w.role, w.engine.device, w.kv_backend, w.kv_fallback) == ("prefill", "cuda:1", "tcp", ("shm",))
    assert (w.kv_policy, w.kv_checksum, w.kv_secret) == ("recompute", "crc32", "a-secret")
    assert w.http_auth and w.engine_config().kv_cache_bytes == 99 << 20


def test_worker_args_override_the_spec():
    m = parse_manifest("runtime: {worker_args: ['--kv-throttle-gbps', '0.5', '--max-num-seqs', '7']}")
    w = _worker(worker_argv(m, "decode", 0, "S"))
    assert (w.kv_throttle_gbps, w.engine.max_num_seqs, w.role, w.engine.block_size) == (0.5, 7, "decode", 16)
    from splitserve.runtime.common import worker_config

    m = parse_manifest("engine: {threads: 2, max_num_batched_tokens: 512}")
    local = _worker(worker_argv(m, "decode", 0, "S"))
    ray = worker_config(m, "decode", 0, "a-secret", "127.0.0.1")
    assert local == ray  # local and Ray workers agree on every knob, the engine's included


@pytest.mark.parametrize(
    "knobs, eager, overlap",
    [
        ("{}", False, None),
        ("{enforce_eager: true, async_scheduling: true}", True, True),
        ("{async_scheduling: false}", False, False),
    ],
)
def test_engine_knobs_reach_the_worker_engine(knobs, eager, overlap, monkeypatch):
    """engine.enforce_eager and engine.async_scheduling travel manifest -> worker argv -> EngineConfig."""
    from splitserve.runtime.common import worker_config
    from splitserve.worker.cli import build_parser, config_from_args

    m = parse_manifest(f"mode: colocated\nengine: {knobs}")
    argv = worker_argv(m, "colocated", 0, "S")
    monkeypatch.setenv("S", "a-secret")
    engine = config_from_args(build_parser().parse_args(argv[3:])).engine_config()
    assert (engine.enforce_eager, engine.async_scheduling) == (eager, overlap)
    direct = worker_config(m, "colocated", 0, "a-secret", "127.0.0.1").engine_config()
    assert (direct.enforce_eager, direct.async_scheduling) == (eager, overlap)


def test_cli_flags_override_the_manifest():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "serve",
            str(EXAMPLES / "disaggregated.yaml"),
            "--port",
            "9123",
            "--host",
            "0.0.0.0",
            "--mode",
            "colocated",
            "--model",
            "/models/x.gguf",
            "--print-manifest",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    m = yaml.safe_load(out.stdout)
    assert m["server"]["port"] == 9123 and m["server"]["host"] == "0.0.0.0"
    assert m["mode"] == "colocated" and m["model"]["source"] == "/models/x.gguf"
    bad = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "serve", "--port", "-5", "--print-manifest"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "server.port" in bad.stderr


POOL_ENGINE = """\
engine:
  max_num_seqs: 64
  kv_cache_mb: 256
  seed: 7
decode:
  engine:
    max_num_seqs: 256
    memory_utilization: 0.5
"""


def test_pool_engine_inherits_what_it_does_not_override():
    m = parse_manifest(POOL_ENGINE)
    assert m.engine_for("prefill") == m.engine  # no override: the top-level section
    assert m.engine_for("colocated") == m.engine
    decode = m.engine_for("decode")
    assert (decode.max_num_seqs, decode.seed, decode.block_size) == (256, 7, 16)
    # the budget is one choice: a pool that gives memory_utilization drops the inherited kv_cache_mb
    assert (decode.kv_cache_mb, decode.memory_utilization) == (None, 0.5)
    assert m.engine.max_num_seqs == 64  # the top level itself is unchanged
    with pytest.raises(ValueError, match="unknown role"):
        m.engine_for("router")


def test_pool_engine_survives_a_dump():
    m = parse_manifest(POOL_ENGINE)
    dumped = yaml.safe_load(dump_manifest(m))
    assert dumped["decode"]["engine"] == {"max_num_seqs": 256, "memory_utilization": 0.5}  # given only
    assert dumped["prefill"]["engine"] == {}
    assert parse_manifest(dump_manifest(m)) == m


def test_documented_pool_engine_example_loads():
    """Uncommenting the example's decode `engine:` block gives a manifest that loads."""
    lines = (EXAMPLES / "disaggregated.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  # engine:"))
    for i in (at, at + 1):
        lines[i] = lines[i].replace("  # ", "  ", 1)
    m = parse_manifest("\n".join(lines))
    assert m.engine_for("decode").max_num_seqs == 256 and m.engine_for("prefill").max_num_seqs == 64


@pytest.mark.parametrize("pool", ["prefill", "decode", "colocated"])
def test_pool_engine_may_not_change_the_kv_layout(pool):
    text = f"engine: {{block_size: 16}}\n{pool}:\n  replicas: 1\n  engine:\n    block_size: 32\n"
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, "layout.yaml")
    (problem,) = info.value.problems
    assert problem.startswith(f"{pool}.engine.block_size (line 5): block_size cannot differ between roles")
    assert "KV layout" in problem and "top-level engine section" in problem


def test_speculation_per_role_and_mtp_on_both_sides_of_the_split():
    ngram = "{method: ngram, num_speculative_tokens: 3}"
    m = parse_manifest(f"mode: disaggregated\ndecode:\n  engine:\n    speculative_config: {ngram}\n")
    assert m.engine_for("decode").speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert m.engine_for("prefill").speculative_config is None
    mtp = "{method: mtp, num_speculative_tokens: 2}"
    both = parse_manifest(f"mode: disaggregated\nengine: {{speculative_config: {mtp}}}\n")
    assert both.engine_for("prefill").speculative_config == both.engine_for("decode").speculative_config
    with pytest.raises(ManifestError, match="both roles or neither"):
        parse_manifest(f"mode: disaggregated\ndecode:\n  engine:\n    speculative_config: {mtp}\n")


@pytest.mark.parametrize("backend", ["tcp", "shm", "cuda_ipc", "nccl", "nixl"])
def test_backends_that_move_whole_blocks_only_are_refused_across_tensor_parallel_sizes(backend):
    sizes = "prefill:\n  engine: {tensor_parallel_size: 2}\ndecode:\n  engine: {tensor_parallel_size: 1}\n"
    text = f"mode: disaggregated\ntransport: {{backend: {backend}}}\n{sizes}"
    same = parse_manifest(
        f"mode: disaggregated\ntransport: {{backend: {backend}}}\nmodel: {{tensor_parallel_size: 2}}\n"
    )
    assert same.tensor_parallel_size("prefill") == same.tensor_parallel_size("decode") == 2
    assert parse_manifest(text.replace("disaggregated", "colocated")).transport.backend == backend
    if backend in ("tcp", "shm", "cuda_ipc"):
        m = parse_manifest(text)
        assert (m.tensor_parallel_size("prefill"), m.tensor_parallel_size("decode")) == (2, 1)
        return
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    (problem,) = info.value.problems
    assert f"kv transport {backend} cannot move KV" in problem
    assert (
        "prefill replica at tensor_parallel_size 2" in problem
        and "decode replica at tensor_parallel_size 1" in problem
    )
    assert "tcp, shm, cuda_ipc" in problem
    with pytest.raises(ManifestError, match=f"transport.fallback: kv transport {backend} cannot"):
        parse_manifest(text.replace(f"backend: {backend}", f"backend: tcp, fallback: [{backend}]"))


def test_pool_engine_errors_name_path_and_line():
    text = """\
mode: disaggregated
decode:
  replicas: 2
  engine:
    max_num_seq: 256
prefill:
  engine: {max_num_seqs: 0}
colocated:
  engine: {kv_cache_mb: 64, memory_utilization: 0.5}
"""
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, "pools.yaml")
    problems = info.value.problems
    assert any(
        "decode.engine.max_num_seq (line 5): unknown field; did you mean 'max_num_seqs'?" in p
        for p in problems
    )
    assert any(
        p.startswith("prefill.engine.max_num_seqs (line 7)") and "greater than or equal to 1" in p
        for p in problems
    )
    assert any(p.startswith("colocated.engine (line 9)") and "not both" in p for p in problems)


def test_set_overrides_reach_a_pool_engine():
    """`--set prefill.engine.max_num_seqs=64` (bench) is an override of the dotted path."""
    m = parse_manifest(
        "decode:\n  engine:\n", overrides={"prefill.engine.max_num_seqs": 64, "decode.engine.seed": 3}
    )
    assert m.engine_for("prefill").max_num_seqs == 64 and m.engine_for("decode").seed == 3
    assert m.engine_for("decode").max_num_seqs == m.engine.max_num_seqs == 128
    with pytest.raises(
        ManifestError, match=r"decode\.engine\.max_num_seq \(line 1\): unknown field; did you mean"
    ):
        parse_manifest("decode: {replicas: 1}", overrides={"decode.engine.max_num_seq": 64})
    with pytest.raises(ManifestError, match=r"prefill\.engine\.block_size: block_size cannot differ"):
        parse_manifest("", overrides={"prefill.engine.block_size": 32})


def test_worker_command_lines_carry_their_pool_engine():
    from splitserve.runtime.common import worker_config

    m = parse_manifest(POOL_ENGINE)
    decode = _worker(worker_argv(m, "decode", 0, "X"), "X")
    prefill = _worker(worker_argv(m, "prefill", 0, "X"), "X")
    d, p = decode.engine, prefill.engine
    assert (d.max_num_seqs, d.gpu_memory_utilization, d.kv_cache_bytes) == (256, 0.5, None)
    assert (p.max_num_seqs, p.kv_cache_bytes) == (64, 256 << 20)  # bytes win over the (default) fraction
    assert worker_config(m, "decode", 0, "s", "127.0.0.1").engine.max_num_seqs == 256
    assert worker_config(m, "prefill", 0, "s", "127.0.0.1").engine.max_num_seqs == 64


@pytest.mark.parametrize("keys", ['[""]', '["  "]', '["k1", ""]'])
def test_an_empty_api_key_is_refused(keys):
    """An empty key is refused: accepted, it would let an empty bearer token authenticate."""
    with pytest.raises(ManifestError, match="an API key must not be empty"):
        parse_manifest(f"server: {{api_keys: {keys}}}")
    assert parse_manifest('server: {api_keys: [" k1 "]}').server.keys() == ["k1"]


_BOMB = 'a: &a ["lol","lol"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n'


@pytest.mark.parametrize(
    ("text", "words"),
    [  # each of these would be accepted, blow up, or take long if not refused
        (_BOMB, "YAML aliases (*name) are not allowed"),
        ("model: {source: &s default, tokenizer: *s}", "YAML aliases"),
        ("server:\n  port: 1\n  port: 2\n", "server.port (line 3): given twice (first on line 2)"),
        (
            "server: " + "{a: " * 20 + "1" + "}" * 20,
            "server.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a: nested more than 16",
        ),
        ("a: " + "[" * 5000 + "]" * 5000, "not valid YAML"),
        (
            "runtime: {health_interval_s: 1.0e-6}",
            "runtime.health_interval_s (line 1): Input should be greater",
        ),
        (
            "router: {timeouts: {request_s: .inf}}",
            "router.timeouts.request_s (line 1): Input should be a finite",
        ),
        ("engine: {threads: 100000}", "engine.threads (line 1): Input should be less than or equal to 1024"),
        ("decode: {replicas: true}", "decode.replicas (line 1): must be a number, not true"),
        ("engine: {kv_cache_mb: 99999999999}", "engine.kv_cache_mb (line 1): Input should be less than"),
    ],
)
def test_hostile_manifests_are_refused_quickly(text, words):
    t0 = time.perf_counter()
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    assert words in str(info.value), str(info.value)
    assert len(str(info.value)) < 2000 and time.perf_counter() - t0 < 1.0


def test_many_unknown_keys_give_a_bounded_error():
    text = "server:\n" + "".join(f"  k{i}: 1\n" for i in range(16_000))
    t0 = time.perf_counter()
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    assert len(info.value.problems) == 21 and info.value.problems[-1] == "... and 15980 more"
    assert time.perf_counter() - t0 < 5.0  # 32 s before (a close-match search per unknown key)


@pytest.mark.parametrize(
    ("text", "words"),
    [  # the HTTP edge's read limits are bounded like every other number
        ("server: {header_timeout_s: .inf}", "server.header_timeout_s (line 1): Input should be"),
        ("server: {body_timeout_s: 0}", "server.body_timeout_s (line 1): Input should be greater"),
        ("server: {max_header_bytes: 99999999999}", "server.max_header_bytes (line 1): Input should be less"),
    ],
)
def test_read_limits_are_bounded(text, words):
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    assert words in str(info.value), str(info.value)
    limits = parse_manifest("server: {header_timeout_s: 5, max_header_bytes: 8192}").server
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.max_header_bytes) == (5.0, 60.0, 8192)
