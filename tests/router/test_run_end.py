"""A choice's task always tells its Run how it ended, so a request never waits for its deadline on a
choice that stopped. The stray cancellation below is injected (a dispatcher stand-in whose awaited
future another task cancels, as a torn-down connection's future would be); the rest is the real Run."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from splitserve.router.openai_protocol import APIError
from splitserve.router.run import Run
from splitserve.sampling.params import SamplingParams


class _StrayCancel:
    """Awaits a future that another task cancels: the CancelledError comes from below, not from Run."""

    async def run(
        self,
        index: int,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        deadline=None,
        stream=False,
        paced=False,
    ):
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, fut.cancel)
        await fut
        yield  # an async generator, as Dispatcher.run is


class _Hang:
    async def run(
        self,
        index: int,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        deadline=None,
        stream=False,
        paced=False,
    ):
        await asyncio.sleep(3600)
        yield


def _run(dispatcher: object, request_s: float = 600.0) -> Run:
    server = SimpleNamespace(
        dispatcher=dispatcher,
        manifest=SimpleNamespace(router=SimpleNamespace(timeouts=SimpleNamespace(request_s=request_s))),
    )
    req = SimpleNamespace(n=1, stream=False)
    return Run(
        server, "completion", req, [([1, 2, 3], "")], SamplingParams(), "cmpl-test", time.perf_counter()
    )


async def test_a_stray_cancellation_below_is_a_500_at_once() -> None:
    run = _run(_StrayCancel())
    run.launch()
    t0 = time.perf_counter()
    with pytest.raises(APIError) as err:
        await asyncio.wait_for(run.next(), 5)
    assert err.value.status == 500 and err.value.code == "choice_cancelled"
    assert time.perf_counter() - t0 < 2
    await run.cancel()


async def test_run_cancel_still_ends_its_choices_quietly() -> None:
    run = _run(_Hang())
    run.launch()
    await asyncio.sleep(0.05)
    await asyncio.wait_for(run.cancel(), 5)
    assert all(t.cancelled() for t in run.tasks)  # its own cancellation is not turned into an error
    assert run.queue.empty()  # nor reported as a choice that finished
