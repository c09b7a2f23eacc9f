"""Cores lent between the CPU workers of one host (core/share.py): the shared slots' arithmetic,
the runtime's slots from a manifest, the invariant lending rests on (a step's results do not depend
on its thread count), and a real disaggregated deployment whose workers borrow each other's core."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from splitserve.config import parse_manifest
from splitserve.core.share import CoreShare, create, open_share
from splitserve.runtime.common import core_share_file, lending_slots, worker_config


def test_a_busy_worker_borrows_what_idle_ones_lend(tmp_path) -> None:
    path = str(tmp_path / "cores")
    create(path, 3)
    a, b, c = (CoreShare(path, slot, own, 4) for slot, own in ((0, 2), (1, 1), (2, 1)))
    assert a.threads(True) == 4  # the others idle: every core
    assert b.threads(True) == 2  # a holds its 2: b gets its own and c's idle one
    assert a.threads(True) == 3  # b busy now
    assert c.threads(True) == 1  # everyone busy: each its own
    assert a.threads(True) == 2
    c.threads(False)
    assert a.threads(True) == 3  # c lends again
    assert a.others_busy() and b.others_busy()
    b.close()
    assert a.threads(True) == 4
    assert not a.others_busy() and c.others_busy()  # an idle c leaves its prefault while a works
    a.threads(False)
    assert not c.others_busy()
    a.close(), c.close()
    with pytest.raises(ValueError, match="slot 5"):
        CoreShare(path, 5, 1, 4)


def test_a_worker_whose_file_is_gone_serves_on_its_own_cores(tmp_path, caplog) -> None:
    """Lending is an optimization: a core that cannot open the runtime's file (removed, say) warns and
    keeps its own threads instead of failing to start."""
    from splitserve.config.worker import WorkerConfig

    path = str(tmp_path / "cores")
    create(path, 2)
    share = open_share(WorkerConfig(threads=1, core_share=path, core_slot=1, core_total=2))
    assert isinstance(share, CoreShare)
    share.close()
    assert (
        open_share(WorkerConfig(threads=2, core_share=path, core_slot=1, core_total=2)) is None
    )  # nothing to add
    with caplog.at_level("WARNING"):
        assert open_share(WorkerConfig(threads=1, core_share=str(tmp_path / "gone"), core_total=2)) is None
        assert open_share(WorkerConfig(threads=1, core_share=path, core_slot=7, core_total=2)) is None
    assert caplog.text.count("no cores lent") == 2


def test_the_runtime_gives_cpu_workers_that_leave_threads_open_a_slot_each() -> None:
    pd = parse_manifest("mode: disaggregated\n", "test")
    assert lending_slots(pd) == {("prefill", 0): 0, ("decode", 0): 1}
    assert lending_slots(parse_manifest("mode: colocated\n", "test")) == {}  # one worker: nobody to lend to
    assert lending_slots(parse_manifest("mode: disaggregated\nruntime: {lend_cores: false}\n", "test")) == {}
    fixed = "mode: disaggregated\nprefill: {engine: {threads: 1}}\n"
    assert lending_slots(parse_manifest(fixed, "test")) == {}  # one lender left: nothing to share
    path = core_share_file(pd)
    assert path is not None and oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    config = worker_config(pd, "decode", 0, None, "127.0.0.1", path)
    assert (config.core_share, config.core_slot, config.core_total) == (path, 1, os.cpu_count())
    assert worker_config(pd, "decode", 0, None, "127.0.0.1").core_share is None  # Ray: never
    # decode pacing: the ITL SLO unless given; decode workers that lend only
    assert config.decode_pace_s == pd.slos.itl_ms / 1e3 == 0.2
    assert worker_config(pd, "prefill", 0, None, "127.0.0.1", path).decode_pace_s == 0.0
    assert worker_config(pd, "decode", 0, None, "127.0.0.1").decode_pace_s == 0.0
    paced = parse_manifest("mode: disaggregated\nruntime: {decode_pace_ms: 0}\nslos: {itl_ms: 50}\n", "t")
    assert worker_config(paced, "decode", 0, None, "127.0.0.1", path).decode_pace_s == 0.0
    paced = parse_manifest("mode: disaggregated\nslos: {itl_ms: 50}\n", "t")
    assert worker_config(paced, "decode", 0, None, "127.0.0.1", path).decode_pace_s == 0.05


@pytest.mark.parametrize("model", [None, "random:qwen3.5-tiny-random"])
def test_a_steps_tokens_and_logprobs_do_not_depend_on_its_thread_count(model: str | None) -> None:
    """What lending relies on: a worker's step may run on 1 or 2 threads depending on the other
    worker's load (and change between layers), so its results must be bit-identical either way. The
    default model with the CPU ops loaded (decode rows' projections through the panels of cpu_gemm on
    AVX-512 hosts, else MKL's GEMV or oneDNN; prompts through oneDNN and the prefill attention op,
    decode rows the paged one), and the hybrid's torch ops."""
    from splitserve.config.engine import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.kernels.cpu import attention as cpu_attention
    from splitserve.kernels.cpu import fused as cpu_fused
    from splitserve.kernels.cpu import gemm as cpu_gemm
    from splitserve.kernels.cpu import prefill as cpu_prefill
    from splitserve.sampling.params import SamplingParams

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no second thread count to compare")
    for op in (cpu_attention, cpu_fused, cpu_gemm, cpu_prefill):
        op.load()  # built now (or found cached): the engine's steps use them from the first one
    config = EngineConfig(
        model=model, progress=False, kv_cache_bytes=64 << 20, max_model_len=1024, enable_prefix_caching=False
    )
    engine = LLMEngine(config, tokenizer=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, detokenize=False)
    before = torch.get_num_threads()

    def run(threads: int, prompts: list[list[int]]) -> list[list[tuple]]:
        torch.set_num_threads(threads)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [[(t.token_id, t.logprob, t.top) for t in done[i].outputs[0].logprobs] for i in ids]

    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    try:
        for batch, length in ((1, 40), (2, 33), (6, 150)):
            prompts = torch.randint(0, vocab, (batch, length), generator=gen).tolist()
            assert run(1, prompts) == run(2, prompts), (batch, length)
    finally:
        torch.set_num_threads(before)


def test_a_disaggregated_deployments_workers_borrow_the_idle_ones_core(disaggregated) -> None:
    """One request at a time: the prefill worker is idle while the answer decodes, so the decode
    worker's steps run on its own core and the prefill worker's (and the other way round for the
    prompt, unless the decode worker is still busy with an earlier request)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to lend")
    disaggregated.wait_idle()
    before = {name: s["threads"] for name, s in disaggregated.worker_stats().items()}
    assert {t["own"] for t in before.values()} == {(os.cpu_count() or 2) // 2}
    r = disaggregated.client().completions.create(
        model="smollm2-135m-instruct", prompt="Count to twenty:", max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.usage.completion_tokens == 16
    after = {name: s["threads"] for name, s in disaggregated.worker_stats().items()}
    decode = next(name for name in after if name.startswith("decode"))
    assert after[decode]["borrowed_steps"] >= before[decode]["borrowed_steps"] + 14
    assert after[decode]["now"] == os.cpu_count()


@pytest.mark.parametrize(
    ("model", "fused"),
    [("random:tiny-random", True), ("random:tiny-random", False), ("random:qwen3.5-tiny-random", False)],
)
def test_the_hook_runs_before_each_layer_and_mlp_product(model: str, fused: bool, monkeypatch) -> None:
    """A borrowed core comes back within one product only if the serving loop's hook (kernels/cpu/threads.py)
    runs at the checkpoints of every forward: before each layer (the decoder's fused CPU path and its
    plain one, and the hybrid's), and in the fused path's prompt steps also before each of a layer's two
    MLP products."""
    from splitserve.config.engine import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.kernels.cpu import fused as cpu_fused
    from splitserve.kernels.cpu import layer as cpu_layer
    from splitserve.kernels.cpu import threads as cpu_threads
    from splitserve.sampling.params import SamplingParams

    if fused and not cpu_fused.load():
        pytest.skip("the fused CPU ops could not be built here")
    # a fused decode step takes the layer op (one checkpoint a layer) once it is loaded, else the prompt
    # path (three): loaded here, so that the count does not depend on whether its background build ended
    layer_op = fused and cpu_layer.load()
    config = EngineConfig(model=model, progress=False, kv_cache_bytes=16 << 20, max_model_len=256)
    engine = LLMEngine(config, tokenizer=False)
    net = engine.runner.model
    if hasattr(net, "cpu_fused"):
        net.cpu_fused = fused
    forward, hooks, per_forward = type(net).forward, [0], []

    def counted(self, input_ids, *args, **kwargs):
        before = hooks[0]
        out = forward(self, input_ids, *args, **kwargs)
        per_forward.append((len(input_ids), hooks[0] - before))
        return out

    monkeypatch.setattr(type(net), "forward", counted)
    cpu_threads.set_hook(lambda: hooks.__setitem__(0, hooks[0] + 1))
    try:
        engine.add_request(list(range(1, 40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        cpu_threads.set_hook(None)
    layers = net.cfg.num_layers
    prompt = 3 * layers if fused else layers
    decode = 3 * layers if fused and not layer_op else layers
    assert len(per_forward) >= 4
    assert per_forward[0] == (39, prompt)  # the prompt's step
    assert all(n == decode for _, n in per_forward[1:])  # decode steps: one a layer through the layer op


def test_a_decode_worker_paces_its_steps_while_the_prefill_worker_is_busy(disaggregated) -> None:
    """A long prompt prefills while another answer decodes: the decode worker lends its core between
    steps (`paced_steps`), and the answer's tokens are the ones it gets alone."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to lend")
    client = disaggregated.client()
    ask = dict(model="smollm2-135m-instruct", prompt="Count to a hundred:", max_tokens=120, temperature=0,
               extra_body={"ignore_eos": True}, logprobs=0)  # fmt: skip
    alone = client.completions.create(**ask).choices[0].logprobs.tokens
    disaggregated.wait_idle()
    before = {name: s["threads"]["paced_steps"] for name, s in disaggregated.worker_stats().items()}
    stream = client.completions.create(**ask, stream=True)
    tokens = list(next(iter(stream)).choices[0].logprobs.tokens)
    long_prompt = " ".join(f"item {i}," for i in range(300))  # ~1,700 tokens: seconds of prefill on 1 core
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(client.completions.create, model="smollm2-135m-instruct", prompt=long_prompt,
                            max_tokens=1)  # fmt: skip
        for chunk in stream:
            tokens += chunk.choices[0].logprobs.tokens if chunk.choices else []
        assert other.result().usage.prompt_tokens > 1000
    assert tokens == alone
    after = {name: s["threads"]["paced_steps"] for name, s in disaggregated.worker_stats().items()}
    decode = next(name for name in after if name.startswith("decode"))
    prefill = next(name for name in after if name.startswith("prefill"))
    assert after[decode] > before[decode] and after[prefill] == before[prefill] == 0


def test_an_import_during_a_pace_starts_and_is_timed_at_once(disaggregated) -> None:
    """Short prompts whose prefill ends while the prefill worker goes on with a long one reach the decode
    worker while it paces (it decodes another answer, the prefill worker is busy): their KV loads start
    and end during the pace, so the transfer a response reports is the load, not up to a pace (200 ms)
    of waiting for the pace to end."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to lend")
    client = disaggregated.client()
    model = "smollm2-135m-instruct"
    disaggregated.wait_idle()
    before = {name: s["threads"]["paced_steps"] for name, s in disaggregated.worker_stats().items()}
    stream = client.completions.create(model=model, prompt="Count to a hundred:", max_tokens=250, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    long_prompt = " ".join(f"item {i}," for i in range(300))  # ~1,700 tokens: two chunks of prefill

    def short(i: int) -> float:
        raw = client.completions.with_raw_response.create(model=model, prompt=f"Say {i}.", max_tokens=3)
        return float(raw.headers["x-splitserve-ttft-transfer-ms"])

    with ThreadPoolExecutor(5) as pool:
        longs = [pool.submit(client.completions.create, model=model, prompt=long_prompt, max_tokens=1)]
        time.sleep(0.3)  # the first long prompt's first chunk is running
        shorts = [pool.submit(short, i) for i in range(3)]  # they join its second chunk
        time.sleep(0.1)
        longs.append(pool.submit(client.completions.create, model=model, prompt=f"More: {long_prompt}",
                                 max_tokens=1))  # fmt: skip  # its chunks run while the shorts import
        transfers = [t.result() for t in shorts]
        assert all(f.result().usage.prompt_tokens > 1000 for f in longs)
    for _ in stream:
        pass
    after = {name: s["threads"]["paced_steps"] for name, s in disaggregated.worker_stats().items()}
    decode = next(name for name in after if name.startswith("decode"))
    assert after[decode] > before[decode]
    assert max(transfers) < 60, transfers  # shm, one block each: milliseconds; a pace's wait was up to 200
