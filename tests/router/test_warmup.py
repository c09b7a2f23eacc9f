"""The warm-up before the ready line (router/warmup.py): a real disaggregated deployment has served a
request of its own through both workers, with the KV handed over, before it says it is ready."""

from __future__ import annotations

from serve_harness import manifest_yaml, start_deployment


def test_a_deployment_serves_a_request_of_its_own_before_the_ready_line() -> None:
    dep = start_deployment(manifest_yaml(mode="disaggregated", runtime={"warm_up": True}))
    try:
        assert any("warm-up: 1 request(s) through the whole path" in line for line in dep.log), dep.log
        stats = dep.wait_idle()  # and it left nothing behind: every block free, nothing running
        for s in stats.values():
            assert s["unfinished"] == 0 and s["blocks"]["free"] == s["blocks"]["total"], stats
        assert all(s["steps"]["forward"] >= 1 for s in stats.values()), stats
        decode = next(s for name, s in stats.items() if name.startswith("decode"))
        assert sum(decode["kv_transfer"]["counts"].values()) >= 1, decode["kv_transfer"]
        r = dep.client().chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )  # fmt: skip
        assert r.choices[0].message.content
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
