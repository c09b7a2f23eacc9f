"""Every error path of a transfer, against an exporter in a background thread and real sockets.

Handshake refusals (layout, secret), timeouts on a dropped or stalled fetch (within the deadline),
corruption caught by checksums, a peer that hangs up mid-transfer, late and unknown leases, and
start-up errors for backends this host cannot run.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch
from kv_helpers import HAVE_LIBFABRIC, HAVE_NIXL, NIXL, SECRET, layout_of, needs_nixl, our_segments, small_kv

from splitserve.transport import (
    AuthError,
    BackendUnavailable,
    CorruptTransfer,
    FaultyTransport,
    KVHandle,
    LeaseExpired,
    PeerRefused,
    TransferTimeout,
    TransportError,
    UnknownLease,
    make_transport,
)
from splitserve.transport.client import SyncChannel, client_handshake
from splitserve.transport.frames import Challenge, Error, Frame, Welcome
from splitserve.transport.protocol import (
    PREFIX,
    Deadline,
    decode_header,
    decode_prefix,
    encode_frame,
    resolve_secret,
)
from splitserve.transport.transport import TransportOptions

BACKENDS = ["tcp", "shm", "shm-direct", NIXL]
MARGIN_S = 0.5


def export_some(exporter, n: int = 4):
    return exporter.export("r1", list(range(2, 2 + n)), n * 16)


# -- handshake -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "peer_kv, peer_fp, expected",
    [
        (small_kv(block_size=32), "m", "block_size: ours 32, peer 16"),
        (small_kv(dtype=torch.float16), "m", "dtype: ours 'float16', peer 'bfloat16'"),
        (small_kv(), "other-model", "model_fingerprint: ours 'other-model', peer 'm'"),
    ],
    ids=["block_size", "dtype", "fingerprint"],
)
def test_mismatched_layout_is_refused_by_both_sides(make, peer_kv, peer_fp, expected):
    exporter = make("tcp")
    handle = export_some(exporter)
    fetcher = make("tcp", kv_cache=peer_kv, layout=layout_of(peer_kv, peer_fp))
    with pytest.raises(PeerRefused) as info:
        fetcher.fetch(handle, [0, 1, 2, 3], timeout_s=5)
    assert expected in info.value.mismatches
    assert exporter.describe().server["refused_layout"] == 1
    assert exporter.describe().counts.get("served", 0) == 0


def test_mismatched_state_shapes_are_listed(make):
    kv = small_kv()
    exporter = make("tcp", kv_cache=kv, layout=layout_of(kv, states=(("conv", (4, 8), "float32"),)))
    handle = exporter.export("r", [1], 16, {"conv": torch.ones(4, 8)})
    fetcher = make("tcp", layout=layout_of(kv, states=(("conv", (4, 9), "float32"),)))
    with pytest.raises(PeerRefused, match=r"state 'conv': ours \(4, 9\) float32, peer \(4, 8\) float32"):
        fetcher.fetch(handle, [0], timeout_s=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_secret_is_refused_before_any_kv(make, backend):
    exporter = make(backend)
    handle = export_some(exporter)
    with pytest.raises(AuthError):
        make(handle.backend, secret="not-the-secret").fetch(handle, [0, 1, 2, 3], timeout_s=5)
    info = exporter.describe()
    assert info.server["refused_auth"] == 1 and info.counts.get("served", 0) == 0


def test_no_secret_at_all_is_a_start_up_error(make):
    with pytest.raises(AuthError, match="SPLITSERVE_KV_SECRET"):
        make("tcp", secret=None)


def test_secret_from_the_environment(make, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_KV_SECRET", SECRET)
    exporter = make("tcp", secret=None)
    make("tcp").fetch(export_some(exporter), [0, 1, 2, 3], timeout_s=5)


def _raw_connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _raw_frame(header: dict, version: int = 1) -> bytes:
    """A frame as an untrusted peer may write it: any JSON header, no checks."""
    data = msgspec.json.encode(header)
    return PREFIX.pack(b"SSKV", version, 0, len(data), 0) + data


def _read_frame(sock: socket.socket) -> tuple[Frame, int]:
    raw = b""
    while len(raw) < PREFIX.size:
        raw += sock.recv(PREFIX.size - len(raw))
    header_len, body_len = decode_prefix(raw)
    data = b""
    while len(data) < header_len:
        data += sock.recv(header_len - len(data))
    return decode_header(data), body_len


@pytest.mark.parametrize("first", ["fetch", "hello-without-proof"])
def test_peer_without_the_secret_gets_nothing(make, first):
    exporter = make("tcp")
    handle = export_some(exporter)
    with _raw_connect(handle.address) as sock:
        assert isinstance(_read_frame(sock)[0], Challenge)
        if first == "fetch":
            sock.sendall(_raw_frame({"op": "fetch", "lease_id": handle.lease_id}))
        else:
            layout = msgspec.to_builtins(exporter.layout)
            sock.sendall(_raw_frame({"op": "hello", "nonce": "00", "layout": layout, "proof": "00" * 32}))
        header, body = _read_frame(sock)
        assert header == Error(code="auth", message=header.message) and body == 0
        assert sock.recv(1 << 16) == b""  # and it hangs up
    assert exporter.describe().counts.get("served", 0) == 0


def test_a_peer_of_another_protocol_version_learns_nothing_of_our_layout(make):
    """Such a peer is refused before it proves the secret, without seeing the exporter's KV layout."""
    exporter = make("tcp")
    with _raw_connect(export_some(exporter).address) as sock:
        assert isinstance(_read_frame(sock)[0], Challenge)
        layout = msgspec.to_builtins(exporter.layout)
        sock.sendall(_raw_frame({"op": "hello", "nonce": "00", "layout": layout, "proof": "00"}, version=99))
        header, _ = _read_frame(sock)
        assert isinstance(header, Error) and header.code == "layout", header
        assert header.layout is None and "protocol_version" in header.message, header


def test_exporter_that_cannot_prove_the_secret_is_refused(make):
    """A fake exporter that answers the handshake with a bogus proof: the fetcher must not trust it."""
    fetcher = make("tcp")
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(encode_frame(Challenge(nonce="ab" * 32)))
            _read_frame(conn)
            conn.sendall(encode_frame(Welcome(proof="00" * 32, layout=fetcher.layout)))
            conn.recv(1)

    threading.Thread(target=impostor, daemon=True).start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    handle = KVHandle("tcp", address, "r", "lease", (0,), 1, fetcher.layout.fingerprint, time.time() + 10)
    with pytest.raises(AuthError, match="could not prove"):
        fetcher.fetch(handle, [1], timeout_s=5)
    listener.close()


# -- faults ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("knob", ["drop", "delay"])
def test_dropped_or_stalled_fetch_times_out_within_the_deadline(make, backend, knob):
    exporter = FaultyTransport(make(backend), **{knob: 1.0}, delay_s=3.0)
    handle = export_some(exporter)
    deadline = 0.5
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        make(handle.backend).fetch(handle, [0, 1, 2, 3], timeout_s=deadline)
    assert time.monotonic() - start < deadline + MARGIN_S
    assert exporter.describe().faults[knob] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_corruption_is_caught_by_the_checksum(make, backend):
    exporter = FaultyTransport(make(backend, checksum="crc32"), corrupt=1.0, seed=3)
    handle = export_some(exporter)
    assert handle.checksum.startswith("crc32:")
    fetcher = make(handle.backend)
    with pytest.raises(CorruptTransfer):
        fetcher.fetch(handle, [0, 1, 2, 3], timeout_s=5)
    assert fetcher.describe().errors == {"CorruptTransfer": 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_blake2b_checksum_round_trip(make, backend):
    exporter = make(backend, checksum="blake2b")
    handle = export_some(exporter)
    fetcher = make(handle.backend, kv_cache=torch.zeros_like(exporter.kv_cache))
    fetcher.fetch(handle, [0, 1, 2, 3], timeout_s=5)
    assert handle.checksum.startswith("blake2b:")
    assert torch.equal(fetcher.kv_cache[[0, 1, 2, 3]], exporter.kv_cache[[2, 3, 4, 5]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_killed_mid_transfer_is_an_error_not_a_hang(make, backend):
    kv = small_kv(num_blocks=2100)  # 4 KiB blocks; 2048 of them = 8 MiB: 8 shm chunks, many sendmsg calls
    exporter = FaultyTransport(make(backend, kv_cache=kv, shm_chunk_mb=1), kill=1.0)
    handle = exporter.export("big", list(range(2048)), 2048 * 16)
    fetcher = make(handle.backend, kv_cache=torch.zeros_like(kv))
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        fetcher.fetch(handle, list(range(10, 2058)), timeout_s=20)
    assert not isinstance(info.value, TransferTimeout)
    assert time.monotonic() - start < 5
    assert not our_segments()
    # the exporter keeps serving: the same lease, fetched again without the fault, arrives intact
    exporter.inner.install_faults(None)
    fetcher.fetch(handle, list(range(10, 2058)), timeout_s=20)
    assert torch.equal(fetcher.kv_cache[10:2058], kv[:2048])


# -- leases ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_fetch_after_lease_expiry(make, backend):
    freed = []
    exporter = make(backend, on_free=freed.append, lease_s=0.2)
    handle = export_some(exporter)
    time.sleep(0.4)
    with pytest.raises(LeaseExpired):
        make(handle.backend).fetch(handle, [0, 1, 2, 3], timeout_s=5)
    assert freed == [[2, 3, 4, 5]]
    exporter.release(handle)  # after expiry: harmless
    assert freed == [[2, 3, 4, 5]]


def test_unknown_lease(make):
    exporter = make("tcp")
    handle = export_some(exporter)
    forged = msgspec.structs.replace(handle, lease_id="nope")
    with pytest.raises(UnknownLease):
        make("tcp").fetch(forged, [0, 1, 2, 3], timeout_s=5)


def test_fetch_checks_its_arguments(make):
    exporter = make("tcp")
    handle = export_some(exporter)
    fetcher = make("tcp")
    with pytest.raises(ValueError, match="4 blocks"):
        fetcher.fetch(handle, [0, 1], timeout_s=5)
    with pytest.raises(ValueError, match="distinct"):
        fetcher.fetch(handle, [0, 1, 1, 2], timeout_s=5)
    with pytest.raises(PeerRefused, match="backend: ours shm, peer tcp"):
        make("shm").fetch(handle, [0, 1, 2, 3], timeout_s=5)
    with pytest.raises(ValueError, match="state tensors"):
        exporter.export("r2", [1], 16, {"conv": torch.zeros(1)})


def test_unreachable_exporter(make):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    fetcher = make("tcp")
    handle = KVHandle("tcp", f"127.0.0.1:{port}", "r", "l", (0,), 1, fetcher.layout.fingerprint, 0.0)
    with pytest.raises(TransportError, match="connect"):
        fetcher.fetch(handle, [1], timeout_s=2)


# -- backends -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "backend, missing",
    [
        pytest.param("nixl", "not installed", marks=pytest.mark.skipif(HAVE_NIXL, reason="NIXL is here")),
        ("cuda_ipc", "CUDA"),
        ("nccl", "CUDA"),
    ],
)
def test_unavailable_backend_is_a_clear_start_up_error(backend, missing):
    kv = small_kv()
    with pytest.raises(BackendUnavailable, match=missing) as info:
        make_transport(backend, kv, layout_of(kv), secret=SECRET)
    assert backend in str(info.value) and "fallback" in str(info.value)


def test_unknown_backend(make):
    with pytest.raises(ValueError, match="known: tcp, shm"):
        make("carrier-pigeon")


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl can run here")
def test_explicit_fallback_is_logged_and_counted(make, caplog):
    with caplog.at_level(logging.WARNING, logger="splitserve.transport.transport"):
        kv = small_kv()
        t = make_transport("nccl", kv, layout_of(kv), secret=SECRET, fallback=["cuda_ipc", "tcp"])
    try:
        info = t.describe()
        assert info.backend == "tcp" and info.requested == "nccl"
        assert info.counts["fallbacks"] == 1 and len(info.fallback_reasons) == 2
        assert any("falling back to 'tcp'" in r.message for r in caplog.records)
    finally:
        t.close()


def test_direct_mode_is_used_for_shared_kv_and_reports_it(make):
    exporter = make("shm-direct", checksum="crc32")
    handle = export_some(exporter)
    fetcher = make("shm", kv_cache=torch.zeros_like(small_kv()))
    fetcher.fetch(handle, [9, 8, 7, 6], timeout_s=5)
    assert torch.equal(fetcher.kv_cache[[9, 8, 7, 6]], small_kv()[[2, 3, 4, 5]])
    assert exporter.describe().shm_mode == "direct" and fetcher.describe().shm_mode == "staged"
    assert fetcher.describe().counts["checksums_verified"] == 1


# -- nixl: the reference deployment's trap (LIBFABRIC asked, UCX is what runs here) -----------------
@needs_nixl
@pytest.mark.skipif(HAVE_LIBFABRIC, reason="libfabric is installed here: LIBFABRIC may instantiate")
def test_nixl_libfabric_alone_refuses_to_start_with_nixls_own_error():
    kv = small_kv()
    options = TransportOptions(nixl_backends=("LIBFABRIC",))
    with pytest.raises(BackendUnavailable) as info:
        make_transport("nixl", kv, layout_of(kv), secret=SECRET, options=options)
    why = str(info.value)
    assert "NIXL_ERR_NOT_FOUND" in why and "unsupported backend 'LIBFABRIC'" in why, why
    assert "libfabric.so.1" in why, why  # and why NIXL could not: its plugin's library is missing


@needs_nixl
@pytest.mark.skipif(HAVE_LIBFABRIC, reason="libfabric is installed here: LIBFABRIC may instantiate")
def test_nixl_declared_fallback_serves_logs_loudly_and_is_counted(make, caplog):
    with caplog.at_level(logging.ERROR, logger="splitserve.transport.nixl.mover"):
        exporter = make("nixl", nixl_backends=("LIBFABRIC", "UCX"), checksum="crc32")
    info = exporter.describe()
    assert info.backend == "nixl/UCX" and info.requested == "nixl/LIBFABRIC", info
    assert info.counts["fallbacks"] == 1 and "NIXL_ERR_NOT_FOUND" in info.fallback_reasons[0]
    assert any("KV TRANSPORT FALLBACK" in r.message for r in caplog.records)
    handle = export_some(exporter)
    fetcher = make("nixl", kv_cache=torch.zeros_like(exporter.kv_cache))
    fetcher.fetch(handle, [0, 1, 2, 3], timeout_s=5)
    assert torch.equal(fetcher.kv_cache[[0, 1, 2, 3]], exporter.kv_cache[[2, 3, 4, 5]])
    got = fetcher.describe()
    assert got.backend == "nixl/UCX" and got.nixl.reads["UCX"] == 1
    assert got.nixl.descriptors_last == 1  # ids 2..5 -> 0..3: one run on both sides, one descriptor


def test_nixl_ucx_error_mode_is_none_for_gpu_memory_and_peer_for_host(monkeypatch):
    from splitserve.transport.nixl.env import UCX_ERROR_ENV, ucx_error_mode

    monkeypatch.delenv(UCX_ERROR_ENV, raising=False)
    assert ucx_error_mode(torch.device("cpu")) == "peer"  # NIXL's default: a dead peer is reported
    assert ucx_error_mode(torch.device("cuda", 0)) == "none"  # else no shared-memory transports (kv-nixl.md)
    monkeypatch.setenv(UCX_ERROR_ENV, "PEER")
    assert ucx_error_mode(torch.device("cuda", 0)) == "peer"


@needs_nixl
def test_nixl_ucx_backend_gets_its_error_mode_with_the_plugins_other_defaults(make, monkeypatch):
    from splitserve.transport.nixl.env import UCX_ERROR_ENV

    monkeypatch.setenv(UCX_ERROR_ENV, "none")  # what a GPU pool gets, here on host memory
    exporter = make("nixl")
    assert exporter.describe().nixl.ucx_error_handling == "none"
    params = exporter.mover.agent.agent.get_backend_params("UCX")  # NixlMover -> NixlAgent -> NIXL's
    assert params.get("ucx_error_handling_mode") == "none" and "num_workers" in params, params
    monkeypatch.setenv(UCX_ERROR_ENV, "peer")
    fetcher = make("nixl", kv_cache=torch.zeros_like(exporter.kv_cache))
    handle = export_some(exporter)
    fetcher.fetch(handle, [0, 1, 2, 3], timeout_s=5)  # peers of either mode still read each other
    assert torch.equal(fetcher.kv_cache[[0, 1, 2, 3]], exporter.kv_cache[[2, 3, 4, 5]])


def test_nixl_turns_cuda_ipc_gets_on_for_gpu_pools_unless_the_operator_chose(monkeypatch):
    from splitserve.transport.nixl.env import CUDA_IPC_GET_ENV, enable_cuda_ipc_get

    monkeypatch.delenv(CUDA_IPC_GET_ENV, raising=False)
    assert enable_cuda_ipc_get(torch.device("cpu")) is None and CUDA_IPC_GET_ENV not in os.environ
    assert enable_cuda_ipc_get(torch.device("cuda", 0)) == "on" == os.environ[CUDA_IPC_GET_ENV]
    monkeypatch.setenv(CUDA_IPC_GET_ENV, "auto")  # UCX's default, asked for explicitly: kept
    assert enable_cuda_ipc_get(torch.device("cuda", 0)) == "auto"


def test_nixl_leaves_ucx_efa_module_out_where_the_host_has_no_efa_device(monkeypatch, tmp_path):
    from splitserve.transport.fabric import probe_fabric
    from splitserve.transport.nixl.env import UCX_MODULES_ENV, skip_efa_without_device

    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"

    def device(name: str, driver: str) -> None:
        dev = sys_root / "class" / "infiniband" / name / "device"
        dev.mkdir(parents=True)
        (sys_root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(sys_root / "drivers" / driver)

    device("mlx5_0", "mlx5_core")
    monkeypatch.delenv(UCX_MODULES_ENV, raising=False)
    infiniband_only = probe_fabric(str(sys_root), str(proc_root))
    assert skip_efa_without_device(infiniband_only) == "^efa" == os.environ[UCX_MODULES_ENV]
    monkeypatch.delenv(UCX_MODULES_ENV)
    device("rdmap0s31", "efa")
    with_efa = probe_fabric(str(sys_root), str(proc_root))
    assert skip_efa_without_device(with_efa) is None and UCX_MODULES_ENV not in os.environ
    monkeypatch.setenv(UCX_MODULES_ENV, "*")  # the operator's choice is kept
    assert skip_efa_without_device(infiniband_only) == "*"


@needs_nixl
def test_a_process_that_used_nixl_exits_cleanly():
    """A NIXL agent with UCX, made and closed: the process then exits with status 0. (UCX's EFA module
    would load the host's libibverbs and libnl beside NIXL's own copies, whose destructors crash at
    exit: env.skip_efa_without_device.)"""
    code = (
        "from splitserve.transport.nixl.agent import NixlAgent\n"
        "NixlAgent('exit-check', ('UCX',)).close()\n"
        "print('closed', flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "closed" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_malformed_request_is_answered_with_what_is_wrong(make):
    """An authenticated peer whose request does not decode gets an error frame naming the field."""
    exporter = make("tcp")
    handle = export_some(exporter)
    deadline = Deadline.after(5)
    chan = SyncChannel.connect(handle.address, deadline)
    try:
        client_handshake(chan, exporter.layout, resolve_secret(SECRET), deadline)
        fetch = {"op": "fetch", "lease_id": handle.lease_id, "request_id": "r1", "timeout_s": "soon"}
        chan.sock.sendall(_raw_frame(fetch))
        header, _ = chan.recv(deadline)
        assert isinstance(header, Error) and header.code == "transport", header
        assert "Expected `float`, got `str` - at `$.timeout_s`" in header.message, header
        assert exporter.describe().server["malformed_frames"] == 1
    finally:
        chan.close()
