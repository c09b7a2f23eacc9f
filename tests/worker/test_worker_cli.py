"""The worker's command line is made from EngineConfig: one flag per engine knob, its defaults the
dataclass's, and a flag given beside `--spec` overrides that field only."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.config.engine import EngineConfig
from splitserve.config.worker import WorkerConfig
from splitserve.worker.cli import build_parser, config_from_args


def _config(*argv: str) -> WorkerConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_every_engine_knob_has_a_flag_and_the_declared_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_KV_SECRET", raising=False)
    options = {s for a in build_parser()._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineConfig):
        if f.name not in ("progress", "kv_shared_memory", "kv_cache_bytes"):
            assert "--" + f.name.replace("_", "-") in options, f.name
    assert _config() == WorkerConfig()
    assert _config().engine == dataclasses.replace(EngineConfig(), progress=False)


def test_flags_reach_the_engine_config() -> None:
    c = _config("--max-num-seqs", "7", "--no-enable-prefix-caching", "--async-scheduling", "off",
                "--kv-cache-mb", "3", "--weight-cache-dir", "off", "--max-model-len", "256")  # fmt: skip
    e = c.engine_config()
    assert (e.max_num_seqs, e.enable_prefix_caching, e.async_scheduling) == (7, False, False)
    assert (e.kv_cache_bytes, e.weight_cache_dir, e.max_model_len) == (3 << 20, None, 256)


def test_a_flag_beside_the_spec_overrides_only_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_KV_SECRET", "s3")
    engine = dataclasses.replace(EngineConfig(progress=False), max_num_seqs=64, block_size=32)
    spec = WorkerConfig(role="decode", engine=engine, kv_backend="shm", kv_secret="s3")
    c = _config("--spec", spec.to_json(include_secret=False), "--max-num-seqs", "9", "--threads", "2")
    assert c == dataclasses.replace(spec, engine=dataclasses.replace(engine, max_num_seqs=9), threads=2)


def test_a_spec_with_unknown_fields_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_KV_SECRET", raising=False)
    with pytest.raises(ValueError, match="unknown engine config fields"):
        WorkerConfig.from_json('{"engine": {"max_num_seq": 3}}')
    with pytest.raises(ValueError, match="the prefill role needs the deployment's shared secret"):
        _config("--role", "prefill")
