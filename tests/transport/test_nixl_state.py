"""A hybrid model's state slots over nixl (one process, two transports): registered once, READ in place
from the exporter's slot into the fetcher's (2 descriptors beside the block runs), checksummed; into a
registered scratch slot when the fetcher names none of its own; copies still travel inline."""

from __future__ import annotations

import torch
from kv_helpers import layout_of, needs_nixl, small_kv

STATES = (("conv", (2, 6, 3), "float32"), ("recurrent", (2, 4, 5, 5), "float32"))


def slot(pool: dict[str, torch.Tensor], s: int) -> dict[str, torch.Tensor]:
    return {name: t[s] for name, t in pool.items()}


@needs_nixl
def test_state_slots_are_read_in_place_by_nixl(make):
    kv = small_kv()
    layout = layout_of(kv, states=STATES)
    exporter = make("nixl", kv_cache=kv, layout=layout, checksum="crc32")
    fetcher = make("nixl", kv_cache=torch.zeros_like(kv), layout=layout)
    theirs, ours = ({name: torch.randn(4, *shape) for name, shape, _ in STATES} for _ in range(2))  # 4 slots
    assert exporter.register_states(theirs) and fetcher.register_states(ours)

    handle = exporter.export("r", [3, 4, 9], 40, slot(theirs, 2))  # kept in slot 2, not copied
    into = slot(ours, 1)
    got = fetcher.fetch(handle, [10, 11, 5], timeout_s=10, into_state=into)
    assert all(got[name].data_ptr() == into[name].data_ptr() for name in into)  # written in place
    assert all(torch.equal(ours[name][1], theirs[name][2]) for name in into)
    assert torch.equal(fetcher.kv_cache[[10, 11, 5]], kv[[3, 4, 9]])
    nixl = fetcher.describe().nixl
    assert nixl.state_reads == 1 and nixl.state_descriptors_last == 2 and nixl.state_inline == 0
    assert fetcher.describe().counts["checksums_verified"] == 1  # the checksum covers the state too

    # no slot of ours (a probe, a library caller): a scratch slot, registered on first use; copies back
    got = fetcher.fetch(handle, [10, 11, 5], timeout_s=10)
    assert all(torch.equal(got[name], theirs[name][2]) for name in got)
    assert got["conv"].data_ptr() != into["conv"].data_ptr()

    # copies (not a registered slot) travel in the frame body, as over tcp
    copies = {name: t[0].clone() for name, t in theirs.items()}
    got = fetcher.fetch(exporter.export("r2", [6], 5, copies), [7], timeout_s=10, into_state=into)
    assert all(torch.equal(got[name], copies[name]) for name in got)
    assert fetcher.describe().nixl.state_inline == 1
