"""Every body that crosses a process is typed: msgspec structs of splitserve/wire (and the sampling leaf's
`SamplingParams`, `TokenLogprob`), read off what each process actually decodes and answers.

What crosses a process (the roots the scan starts from):
  - every msgspec struct defined in a module of splitserve/wire, and the KV transports' control frames
    (transport/frames.py: every struct there, and the union the transports decode);
  - what each process decodes: the engine core's commands and its spec line, the front end's batches,
    the worker routes' bodies (`_body(request, X)` in worker/app.py), the router's, the gate's and the
    local runtime's decodes of worker answers, and the transports' decodes of frames
    (`msgspec.json.decode(..., type=X)`, `Decoder(X)`);
  - what the worker's operations answer (the return types of `Worker`'s public methods).
From those, every field's type is walked (msgspec.inspect). A field fails if it is `Any` (an untyped
`dict` or `list` is one too: its items are `Any`), or a `dict` not listed in MAPS (a map is allowed where
its keys are data, not field names). OPEN lists the diagnostic trees that stay free in shape.
No transport module builds a frame as a dict (a literal with an "op" key), or encodes one by hand.
And the KV handle has one wire type: `KVExport` (the handle and the generator state) is the only type
that carries it, and no other class anywhere in splitserve/ redeclares the handle's fields.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import typing
from pathlib import Path

import msgspec
import msgspec.inspect as mi

import splitserve.wire
from splitserve.transport import frames
from splitserve.transport.layout import KVLayout
from splitserve.wire.kv_handle import KVExport, KVHandle

ROOT = Path(__file__).resolve().parents[2] / "splitserve"

# Fields whose type is a dict: keys that are data (names of phases, counters, error classes), not fields.
MAPS: dict[str, str] = {
    "Health.startup": "start-up phase -> the process's age when it ended",
    "ReadyLine.startup": "the same, in the ready line (which carries the health)",
    "ReadyLine.front_end": "the front end's start-up phase -> its age when it ended",
    "KVTransferCounts.counts": "counter name -> running total (the connector adds counters as it grows)",
    "KVTransferCounts.failures": "error class -> failed fetches",
    "CoreFork.env": "environment variable -> value, the forked engine core's environment",
    # the transport's self-description (wire/transport_info.py), its maps and the mover's part of it
    **{
        f"{cls}.{name}": what
        for cls in ("TransportInfo", "MoverInfo")
        for name, what in {
            "copies": "how a GPU mover's blocks moved -> count",
            "fetch_phases_ms": "a fetch's phase -> its median ms",
            "serve_phases_ms": "a served fetch's phase -> its median ms",
        }.items()
    },
    "TransportInfo.counts": "the transport's counter name -> running total",
    "TransportInfo.errors": "error class -> failed transfers",
    "TransportInfo.server": "the exporter's server: counter (connections, refusals by cause) -> count",
    "TransportInfo.faults": "injected fault kind -> count (tests)",
    "CudaIpcInfo.p2p_access": "another GPU's index -> whether this GPU reaches it directly",
    "NixlInfo.failed": "NIXL backend -> why it did not start",
    "NixlInfo.reads": "NIXL backend that served reads -> reads",
    "RankParts.by_prefill_rank": "a prefill rank -> bytes one decode rank fetched from it",
}
# Diagnostic trees free in shape, which no code reads (wire/stats.py `Diagnostics`). Shrink this list;
# never grow it.
OPEN: dict[str, str] = {
    "Health.load": "the weight loader's report: stages and reader statistics vary by load method",
    "ReadyLine.load": "the same, in the ready line",
}
# Modules whose decodes of bodies from another process are scanned for their target types.
DECODING = ("worker", "core", "router", "gate", "runtime", "transport")


def _wire_structs() -> list[type]:
    out = []
    names = [f"splitserve.wire.{info.name}" for info in pkgutil.iter_modules(splitserve.wire.__path__)]
    for name in [*names, "splitserve.transport.frames"]:
        mod = importlib.import_module(name)
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == mod.__name__:
                out.append(obj)
    return out


def _decoded_types() -> list[object]:
    """The target of each typed msgspec decode in the process packages, and the worker routes' bodies."""
    out: list[object] = []
    for pkg in DECODING:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            targets = []
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                targets += [k.value for k in node.keywords if k.arg == "type" and name.endswith("decode")]
                if name.endswith(("Decoder", "convert")) and node.args:
                    targets.append(node.args[-1] if name.endswith("convert") else node.args[0])
                if name == "_body" and len(node.args) == 2:
                    targets.append(node.args[1])
            if not targets:
                continue
            module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
            namespace = vars(importlib.import_module(module))
            for t in targets:
                try:
                    out.append(eval(ast.unparse(t), namespace))  # noqa: S307 - a name or an attribute
                except NameError:
                    continue  # a parameter (a generic helper's `kind`): its callers are scanned
    return out


def _worker_answers() -> list[object]:
    from splitserve.worker.service import Worker

    out = []
    for name, fn in inspect.getmembers(Worker, inspect.isfunction):
        if name.startswith("_"):
            continue
        hints = typing.get_type_hints(fn)
        out += [t for key, t in hints.items() if key != "return" or t is not type(None)]
    return out


def _roots() -> list[object]:
    from splitserve.wire import core, http

    return [*_wire_structs(), core.command_decoder.type, core.batch_decoder.type, http.LINE_DECODER.type,
            *_decoded_types(), *_worker_answers()]  # fmt: skip


def _msgspec_types(t: object) -> bool:
    """Whether msgspec can describe `t` (the scan skips process-internal types such as a tokenizer)."""
    try:
        mi.type_info(t)
    except TypeError:
        return False
    return True


def _walk(t: mi.Type, where: str, seen: set[int], found: list[tuple[str, mi.Type]]) -> None:
    found.append((where, t))
    if isinstance(t, mi.StructType | mi.DataclassType):
        if id(t.cls) in seen:
            return
        seen.add(id(t.cls))
        for f in t.fields:
            _walk(f.type, f"{t.cls.__name__}.{f.name}", seen, found)
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            _walk(x, where, seen, found)
    elif isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        _walk(t.item_type, where, seen, found)
    elif isinstance(t, mi.TupleType):
        for x in t.item_types:
            _walk(x, where, seen, found)
    elif isinstance(t, mi.DictType):
        _walk(t.key_type, where, seen, found)
        _walk(t.value_type, where, seen, found)


def _everything() -> list[tuple[str, mi.Type]]:
    found: list[tuple[str, mi.Type]] = []
    seen: set[int] = set()
    for root in _roots():
        if _msgspec_types(root):
            _walk(mi.type_info(root), getattr(root, "__name__", str(root)), seen, found)
    return found


def test_the_scan_sees_every_edge() -> None:
    """The roots include what each process decodes and answers (a broken scan must not pass by seeing
    nothing)."""
    from splitserve.wire import core, http, ops, stats

    names = {t.cls.__name__ for _, t in _everything() if isinstance(t, mi.StructType)}
    for cls in (core.Add, core.Import, core.Batch, core.Delta, core.CoreSpec, http.PrefillRequest,
                http.PrefillResponse, http.DecodeRequest, http.StreamLine, ops.Probe, ops.ProbeResult,
                stats.WorkerStats, stats.Health, KVExport, KVHandle):  # fmt: skip
        assert cls.__name__ in names, cls
    for name in ("SamplingParams", "GrammarSpec", "TokenLogprob", "Timings"):
        assert name in names, name
    frames_seen = {t.cls for _, t in _everything() if isinstance(t, mi.StructType)}
    assert set(typing.get_args(frames.AnyFrame)) <= frames_seen
    for cls in (
        frames.Hello,
        frames.Error,
        frames.KvNixl,
        frames.CudaIpcShare,
        frames.ArenaShare,
        frames.Region,
    ):
        assert cls in frames_seen, cls
    assert any(isinstance(t, mi.DataclassType) and t.cls is KVLayout for _, t in _everything())


def test_no_transport_frame_is_a_dict() -> None:
    """Frames are built as structs: no dict literal with an "op" key in the transports, and only
    frames.py turns a header into bytes or back (no json module there either)."""
    found = []
    for path in sorted((ROOT / "transport").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value == "op" for k in node.keys
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports json" for m in mods if m == "json"]
    assert not found, found


def test_the_transport_describes_itself_in_a_wire_struct() -> None:
    """The transport's self-description reaches /stats as `TransportInfo` (scanned with WorkerStats), and
    every `describe()` of the transports, their movers and links, and the tensor-parallel group returns
    a struct of wire/transport_info.py, never a dict."""
    from splitserve.wire import transport_info

    assert "KVTransferCounts.transport" not in OPEN
    structs = {t.cls for _, t in _everything() if isinstance(t, mi.StructType)}
    assert {transport_info.TransportInfo, transport_info.NixlInfo, transport_info.CudaIpcInfo} <= structs
    wire_names = set(transport_info.__all__)
    found = []
    for path in [*sorted((ROOT / "transport").rglob("*.py")), ROOT / "engine" / "tp" / "kv_transport.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "describe":
                returns = ast.unparse(node.returns) if node.returns is not None else "(none)"
                if not set(returns.replace(" ", "").split("|")) <= wire_names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} -> {returns}")
    assert not found, found


def test_no_untyped_field_crosses_a_process() -> None:
    bad = sorted(
        {where for where, t in _everything() if isinstance(t, mi.AnyType) and where not in OPEN}
        | {where for where, t in _everything() if isinstance(t, mi.DictType) and where not in MAPS | OPEN}
    )
    assert not bad, f"untyped (Any, an untyped dict or list) or unlisted dict fields on the wire: {bad}"


def test_the_listed_exceptions_still_exist() -> None:
    wheres = {where for where, _ in _everything()}
    assert set(MAPS) | set(OPEN) <= wheres, sorted(set(MAPS) | set(OPEN) - wheres)


def test_the_kv_handle_has_one_wire_type() -> None:
    """KVHandle appears only inside KVExport; every other body names KVExport."""
    holders = set()
    for where, t in _everything():
        if isinstance(t, mi.StructType) and t.cls is KVHandle and "." in where:  # a field, not a root
            holders.add(where)
    assert holders <= {"KVExport.handle"}, holders


def test_no_other_class_redeclares_the_handle() -> None:
    """The handle's identifying fields are declared once (wire/kv_handle.py), in no pydantic body,
    dataclass or struct elsewhere; and nothing in the wire package or beside KVExport converts by hand."""
    marks = {"lease_id", "block_ids", "layout_fingerprint"}
    declared, converters = [], []
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                          and isinstance(s.target, ast.Name)}  # fmt: skip
                if marks <= fields:
                    declared.append(f"{path.relative_to(ROOT)}:{node.name}")
            in_wire = "wire" in path.relative_to(ROOT).parts or path.name == "kv_transfer_types.py"
            if in_wire and isinstance(node, ast.FunctionDef) and node.name in ("to_dict", "from_dict"):
                converters.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert declared == ["wire/kv_handle.py:KVHandle"], declared
    assert not converters, converters
