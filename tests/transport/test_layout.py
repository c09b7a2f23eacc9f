"""KVLayout, KVHandle, frames, proofs and payload views: the pure pieces under the transports."""

from __future__ import annotations

import re
from dataclasses import replace

import msgspec
import numpy as np
import pytest
import torch
from kv_helpers import layout_of, small_kv

from splitserve.transport import KVHandle, KVLayout, LeaseExpired, PeerRefused, TransportError
from splitserve.transport.frames import Done, Error, Kv, MalformedFrame, Ok
from splitserve.transport.payload import BlockSink, ByteStream, block_runs, source_pieces
from splitserve.transport.protocol import (
    PREFIX,
    checksum,
    decode_header,
    decode_prefix,
    encode_frame,
    expect,
    proof,
    proof_ok,
    resolve_secret,
)

BASE = KVLayout("llama-3-8b@abc", "bfloat16", 16, 32, 8, 128, (("conv", (4, 8), "float32"),))


def test_block_nbytes_and_payload():
    assert BASE.block_nbytes == 32 * 2 * 16 * 8 * 128 * 2
    assert BASE.state_nbytes == 4 * 8 * 4
    assert BASE.payload_nbytes(3) == 3 * BASE.block_nbytes + 128


def test_from_tensor_reads_the_engine_layout():
    kv = torch.zeros(10, 4, 2, 16, 2, 64, dtype=torch.float16)
    layout = KVLayout.from_tensor(kv, "fp", [("s", [3], "float32")])
    assert (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim) == (4, 16, 2, 64)
    assert layout.dtype == "float16" and layout.state_shapes == (("s", (3,), "float32"),)
    assert layout.block_nbytes == kv[0].numel() * 2
    with pytest.raises(ValueError, match="expected kv"):
        KVLayout.from_tensor(torch.zeros(10, 4, 16, 2, 64), "fp")


def test_mismatches_in_words():
    other = KVLayout(
        "qwen3-8b@def", "float16", 32, 32, 8, 128, (("conv", (4, 9), "float32"), ("ssm", (2,), "float32")), 2
    )
    assert BASE.mismatches(BASE) == []
    assert BASE.mismatches(other) == [
        "model_fingerprint: ours 'llama-3-8b@abc', peer 'qwen3-8b@def'",
        "dtype: ours 'bfloat16', peer 'float16'",
        "block_size: ours 16, peer 32",
        "protocol_version: ours 1, peer 2",
        "state 'conv': ours (4, 8) float32, peer (4, 9) float32",
        "state 'ssm': ours has none, peer (2,) float32",
    ]


def test_fingerprint_and_json_round_trip():
    again = msgspec.json.decode(msgspec.json.encode(BASE), type=KVLayout)
    assert again == BASE and again.fingerprint == BASE.fingerprint
    assert replace(BASE, head_dim=64).fingerprint != BASE.fingerprint
    with pytest.raises(msgspec.ValidationError, match="missing required field"):
        msgspec.json.decode(b'{"dtype": "bfloat16"}', type=KVLayout)
    with pytest.raises(msgspec.ValidationError, match="unknown dtype"):  # __post_init__'s checks run
        msgspec.json.decode(msgspec.json.encode(BASE).replace(b"bfloat16", b"bfloat17"), type=KVLayout)
    with pytest.raises(ValueError, match="unknown dtype"):
        KVLayout("m", "bfloat17", 16, 1, 1, 1)


def test_handle_json_round_trip():
    handle = KVHandle(
        "tcp", "127.0.0.1:5555", "req-1", "lease", [4, 5], 20, BASE.fingerprint, 1e9, "crc32:00"
    )
    again = msgspec.json.decode(msgspec.json.encode(handle), type=KVHandle)
    assert again == handle and again.block_ids == (4, 5)
    with pytest.raises(msgspec.ValidationError, match="missing required field"):
        msgspec.json.decode(b'{"backend": "tcp"}', type=KVHandle)


def test_frames():
    kv = Kv(blocks=3, checksum="crc32:00", nbytes=123)
    frame = encode_frame(kv, body_nbytes=123)
    assert decode_prefix(frame[: PREFIX.size]) == (len(frame) - PREFIX.size, 123)
    assert frame[PREFIX.size :] == b'{"op":"kv","blocks":3,"checksum":"crc32:00","nbytes":123}'
    assert decode_header(frame[PREFIX.size :]) == kv
    with pytest.raises(TransportError, match="magic"):
        decode_prefix(b"HTTP" + frame[4 : PREFIX.size])
    newer = PREFIX.pack(b"SSKV", 99, 0, 2, 0)
    with pytest.raises(PeerRefused, match="protocol_version: ours 1, peer 99"):
        decode_prefix(newer)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"[1, 2]", "Expected `object`, got `array`"),
        (b"not json", "JSON is malformed"),
        (b'{"lease_id": "L"}', "missing required field `op`"),
        (b'{"op": "steal", "lease_id": "L"}', "Invalid value 'steal' - at `$.op`"),
        (b'{"op": "fetch", "lease_id": "L", "request_id": "r"}', "missing required field `timeout_s`"),
        (b'{"op": "ack", "slot": "0"}', "Expected `int`, got `str` - at `$.slot`"),
        (b'{"op": "kv_cuda", "blocks": 1, "block_ids": "%%"}', "Invalid base64"),
        (b'{"op": "welcome", "proof": "p", "layout": {"dtype": "x"}}', "at `$.layout`"),
    ],
)
def test_a_malformed_frame_says_what_is_wrong(raw, says):
    with pytest.raises(MalformedFrame, match=re.escape(says)):
        decode_header(raw)


def test_frames_expected_and_error_frames_raised_as_their_class():
    assert expect(Ok(released=True), Ok).released is True
    with pytest.raises(TransportError, match="expected 'ok', got 'done'"):
        expect(Done(), Ok)
    with pytest.raises(LeaseExpired, match="from the peer: gone"):
        expect(Error(code="lease_expired", message="gone"), Ok)
    refusal = Error.of(PeerRefused("refused", ["block_size: ours 16, peer 32"]), BASE)
    again = decode_header(encode_frame(refusal)[PREFIX.size :])
    assert again == refusal and again.layout == BASE
    with pytest.raises(PeerRefused, match="block_size: ours 16, peer 32"):
        expect(again, Ok)


def test_proofs_bind_secret_role_and_layout():
    p = proof(b"k", "client", "n1", "n2", BASE)
    assert proof_ok(p, p)
    assert not proof_ok(p, proof(b"other", "client", "n1", "n2", BASE))
    assert not proof_ok(p, proof(b"k", "server", "n1", "n2", BASE))
    assert not proof_ok(p, proof(b"k", "client", "n1", "n2", replace(BASE, head_dim=1)))
    assert not proof_ok(p, None)


def test_secret_resolution(monkeypatch):
    assert resolve_secret("abc") == b"abc"
    monkeypatch.setenv("SPLITSERVE_KV_SECRET", "from-env")
    assert resolve_secret(None) == b"from-env"


def test_byte_stream_windows_and_copies():
    a, b = np.arange(10, dtype=np.uint8), np.arange(100, 105, dtype=np.uint8)
    stream = ByteStream([a, np.empty(0, np.uint8), b])
    assert stream.nbytes == 15
    assert [w.tolist() for w in stream.window(8, 4)] == [[8, 9], [100, 101]]
    out = np.zeros(6, np.uint8)
    stream.copy_to(7, out)
    assert out.tolist() == [7, 8, 9, 100, 101, 102]
    stream.copy_from(9, np.full(3, 7, np.uint8))
    assert a[9] == 7 and b[:2].tolist() == [7, 7]
    assert checksum("crc32", [a, b]) == checksum("crc32", [np.concatenate([a, b])])


def test_block_runs_and_zero_copy_views():
    assert block_runs([5, 6, 7, 2, 3, 9]) == [(5, 3), (2, 2), (9, 1)]
    kv = small_kv()
    pieces = source_pieces(kv, [5, 6, 7, 2])
    assert len(pieces) == 2 and pieces[0].nbytes == 3 * layout_of(kv).block_nbytes
    assert np.shares_memory(pieces[0], kv.view(torch.uint8).numpy())


def test_staged_path_used_for_device_kv_round_trips_on_cpu():
    src, dst = small_kv(seed=1), torch.zeros_like(small_kv())
    staged = source_pieces(src, [4, 1, 2], stage=True)
    sink = BlockSink(dst, [0, 9, 3], stage=True)
    ByteStream(sink.pieces).copy_from(0, staged[0])
    assert not dst.any()  # nothing lands before commit
    sink.commit()
    assert torch.equal(dst[[0, 9, 3]], src[[4, 1, 2]])
