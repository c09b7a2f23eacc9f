"""The worker wire protocol's KV handle: one typed shape, in step with `kv.KVHandle`, round-tripping."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from splitserve.engine.kv_transfer_types import KVExport
from splitserve.transport import KVHandle
from splitserve.wire.http import DecodeRequest, KVExportBody, KVHandleBody, PrefillResponse

HANDLE = KVHandle(
    backend="tcp", address="127.0.0.1:5000", request_id="pf-1", lease_id="L1", block_ids=(3, 4, 9),
    num_tokens=40, layout_fingerprint="abc", lease_expires_at=1.5e9, checksum="crc32:00ff00ff",
)  # fmt: skip


def test_handle_body_has_the_handles_fields() -> None:
    assert set(KVHandleBody.model_fields) == {f.name for f in dataclasses.fields(KVHandle)}


def test_export_round_trips_through_the_wire_shape() -> None:
    export = KVExport(HANDLE, generator_state=b"\x00\x01seed")
    body = KVExportBody.model_validate(export.to_dict())
    assert body.handle.to_handle() == HANDLE
    assert KVExport.from_dict(body.model_dump()) == export
    assert KVHandleBody.of(HANDLE).to_handle() == HANDLE


def test_the_bodies_carrying_it_are_typed() -> None:
    wire = PrefillResponse(
        request_id="pf-1", first_token=7, text="x", finish_reason=None, seconds=0.1,
        kv_export=KVExport(HANDLE).to_dict(),  # type: ignore[arg-type]  # validated from JSON-shaped input
    )  # fmt: skip
    again = PrefillResponse.model_validate_json(wire.model_dump_json())
    assert again.kv_export is not None and again.kv_export.handle.block_ids == [3, 4, 9]
    body = DecodeRequest(prompt_token_ids=[1, 2], first_token=7, kv_export=again.kv_export)
    assert DecodeRequest.model_validate_json(body.model_dump_json()).kv_export == again.kv_export


@pytest.mark.parametrize(
    "bad",
    [
        {"handle": {**KVExport(HANDLE).to_dict()["handle"], "block_ids": "nope"}},
        {"handle": {**KVExport(HANDLE).to_dict()["handle"], "surprise": 1}},
        {"handle": {k: v for k, v in KVExport(HANDLE).to_dict()["handle"].items() if k != "lease_id"}},
        {"handle": {**KVExport(HANDLE).to_dict()["handle"], "num_tokens": -1}},
    ],
)
def test_a_malformed_handle_is_refused_at_the_edge(bad: dict) -> None:
    with pytest.raises(ValidationError):
        DecodeRequest(prompt_token_ids=[1], first_token=2, kv_export=bad)  # type: ignore[arg-type]
