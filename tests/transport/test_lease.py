"""LeaseManager: a lease ends exactly once, by release or by expiry, never under a running fetch."""

from __future__ import annotations

import threading

import pytest
from kv_helpers import wait_for

from splitserve.transport import LeaseExpired, LeaseManager, UnknownLease


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def freed():
    return []


def test_release_frees_exactly_once(freed):
    leases = LeaseManager(10.0, freed.append)
    lease = leases.grant([3, 4])
    assert leases.release(lease.lease_id) is True
    assert leases.release(lease.lease_id) is False  # twice: harmless
    assert freed == [[3, 4]] and leases.active() == 0
    leases.close()
    assert freed == [[3, 4]]


def test_expiry_frees_exactly_once_on_the_reaper_thread(freed):
    threads = []
    leases = LeaseManager(0.1, lambda ids: (freed.append(ids), threads.append(threading.current_thread())))
    lease = leases.grant([7])
    assert wait_for(lambda: freed == [[7]], timeout_s=2)
    assert threads[0].name == "kv-lease-reaper"
    assert leases.release(lease.lease_id) is False  # after expiry: harmless
    with pytest.raises(LeaseExpired, match="expired"):
        with leases.pinned(lease.lease_id):
            pass
    leases.close()
    assert freed == [[7]] and leases.counts["expired"] == 1


def test_expiry_is_deferred_while_a_fetch_reads_the_blocks(freed):
    clock = FakeClock()
    leases = LeaseManager(5.0, freed.append, clock=clock, reaper=False)
    lease = leases.grant([1, 2])
    with leases.pinned(lease.lease_id):
        clock.now = 10.0
        assert leases.expire_due() == 1  # due, but pinned: ends when the fetch is done
        assert leases.release(lease.lease_id) is False
        assert freed == []
    assert freed == [[1, 2]]
    leases.close()


def test_release_during_a_fetch_waits_for_it(freed):
    leases = LeaseManager(5.0, freed.append)
    lease = leases.grant([9])
    with leases.pinned(lease.lease_id):
        with leases.pinned(lease.lease_id):  # two concurrent fetches of one lease
            assert leases.release(lease.lease_id) is True
        assert freed == []
    assert freed == [[9]]
    leases.close()


def test_pinning_an_overdue_lease_ends_it(freed):
    clock = FakeClock()
    leases = LeaseManager(1.0, freed.append, clock=clock, reaper=False)
    lease = leases.grant([5])
    clock.now = 2.0  # the reaper has not run yet
    with pytest.raises(LeaseExpired):
        with leases.pinned(lease.lease_id):
            pass
    assert freed == [[5]]
    with pytest.raises(UnknownLease):
        with leases.pinned("never-granted"):
            pass
    leases.close()


def test_racing_releases_and_expiries_free_each_lease_once():
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def on_free(ids):
        with lock:
            counts[ids[0]] = counts.get(ids[0], 0) + 1

    clock = FakeClock()
    leases = LeaseManager(1.0, on_free, clock=clock, reaper=False)
    granted = [leases.grant([i]) for i in range(300)]
    clock.now = 5.0
    barrier = threading.Barrier(4)

    def releaser(part):
        barrier.wait()
        for lease in granted[part::2]:
            leases.release(lease.lease_id)

    def expirer():
        barrier.wait()
        leases.expire_due()

    workers = [threading.Thread(target=releaser, args=(p,)) for p in (0, 1)]
    workers += [threading.Thread(target=expirer) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    leases.close()
    assert counts == {i: 1 for i in range(300)}


def test_close_frees_what_is_still_held(freed):
    leases = LeaseManager(60.0, freed.append)
    leases.grant([1])
    leases.grant([2])
    leases.close()
    assert sorted(freed) == [[1], [2]]
    with pytest.raises(RuntimeError):
        leases.grant([3])


def test_on_free_that_raises_still_ends_the_lease(caplog):
    calls = []

    def bad(ids):
        calls.append(ids)
        raise RuntimeError("engine said no")

    leases = LeaseManager(60.0, bad)
    lease = leases.grant([4])
    assert leases.release(lease.lease_id) is True
    assert leases.release(lease.lease_id) is False
    assert calls == [[4]] and "on_free raised" in caplog.text
    leases.close()
