"""The wire's types (``autogpu_jupyter/server/schema.py``) are what the endpoints send: each
payload's real answer, built in this process over a simulated fleet, a real lease registry and
real kernel processes, has exactly the keys and value types its ``TypedDict`` names (what
``labextension/src/schema.ts`` is generated from), and the JSON that core objects write
(``DeviceSnapshot.to_dict``, ``Constraints.to_json``, the cluster's) has the schema's keys."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.server import moving, payloads, schema
from autogpu_jupyter.server.state import current_user
from tests.payloadhelpers import GiB, Kernels, recorded_prometheus, server_state, write_fleet

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
ME = current_user()


def mismatches(value: object, tp: object, where: str = "answer") -> list[str]:
    """Where ``value`` (decoded JSON) is not of type ``tp``: a key missing or extra, a value
    of another type (an int is a number; a bool is not)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        tries = [mismatches(value, a, where) for a in args]
        return [] if any(not t for t in tries) else min(tries, key=len)
    if origin is typing.Literal:
        return [] if value in args else [f"{where}: {value!r} not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__}, not a list"]
        return [m for i, v in enumerate(value) for m in mismatches(v, args[0], f"{where}[{i}]")]
    if isinstance(tp, type) and typing.is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not a {tp.__name__}"]
        hints = typing.get_type_hints(tp)
        required: frozenset[str] = getattr(tp, "__required_keys__", frozenset())
        out = [f"{where}: missing {k!r}" for k in required if k not in value]
        out += [f"{where}: extra {k!r}" for k in value if k not in hints]
        for k, v in value.items():
            if k in hints:
                out += mismatches(v, hints[k], f"{where}.{k}")
        return out
    ok = {
        str: isinstance(value, str),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        type(None): value is None,
    }[tp]  # type: ignore[index]
    return [] if ok else [f"{where}: {value!r} is not {getattr(tp, '__name__', tp)}"]


def wire(answer: object) -> object:
    """The answer as the browser reads it (through JSON, as the handlers write it)."""
    return json.loads(json.dumps(answer, allow_nan=False))


def test_the_checker_catches_a_missing_an_extra_and_a_mistyped_field() -> None:
    good = {"uuid": A, "label": "GPU 0"}
    assert mismatches(good, schema.BetterDevice) == []
    assert mismatches({"uuid": A}, schema.BetterDevice) == ["answer: missing 'label'"]
    assert mismatches({**good, "x": 1}, schema.BetterDevice) == ["answer: extra 'x'"]
    assert mismatches({"uuid": A, "label": None}, schema.BetterDevice) == [
        "answer.label: None is not str"]
    assert mismatches({"cancelled": 1}, schema.CancelAnswer) == ["answer.cancelled: 1 is not bool"]


@pytest.fixture
def kernels() -> Iterator[Kernels]:
    k = Kernels("k-1", "k-2")
    yield k
    k.close()


def test_every_local_answer_is_what_its_schema_type_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """devices, history, holders (a lease, a process, an overloaded kernel with a better
    device), select (a pick and nothing fits), cluster (Prometheus unset)."""
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    fleet_file = write_fleet(tmp_path / "fleet.json", [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 78 * GiB,
         "utilization_pct": 10, "processes": [
             {"pid": kernels.pid("k-1"), "used_memory": 8 * GiB, "user": ME,
              "command": "python -m ipykernel_launcher"},
             {"pid": 51002, "used_memory": 70 * GiB, "user": "bob", "command": "python b.py"}]},
        {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
         "utilization_pct": 0},
    ])
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        with DirectoryStore(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[B], requested_bytes=10 * GiB,
                               requester=Requester(kernel_id="k-2"))
        try:
            ctx = state.context()
            answers: list[tuple[object, object]] = [
                (payloads.devices_payload(ctx), schema.DevicesAnswer),
                (payloads.history_payload(ctx, None), schema.HistoryAnswer),
                (payloads.history_payload(ctx, 1.0), schema.HistoryAnswer),
                (payloads.holders_payload(ctx, kernels, {"k-1": {"path": "a.ipynb"}}),
                 schema.HoldersAnswer),
                (payloads.holders_payload(ctx, None, {}), schema.HoldersAnswer),
                (payloads.select_payload(ctx, Constraints.parse(min_free="10G")),
                 schema.SelectAnswer),
                (payloads.select_payload(ctx, Constraints.parse(min_free="500G")),
                 schema.SelectAnswer),
                (payloads.cluster_payload(ctx, Constraints()), schema.ClusterAnswer),
                (payloads.cluster_history_payload(ctx, 600.0), schema.ClusterHistoryAnswer),
            ]
        finally:
            lease.release()
    for answer, tp in answers:
        assert mismatches(wire(answer), tp) == [], tp
    holders = typing.cast(dict[str, Any], answers[3][0])
    # the answer had something in each place the types describe
    assert {h["kind"] for h in holders["holders"]} == {"lease", "process"}
    assert [k["better"] for k in holders["kernels"] if k["kernel_id"] == "k-1"] == [
        {"uuid": B, "label": "GPU 1"}]
    assert "allocation" in typing.cast(dict[str, Any], answers[5][0])
    assert typing.cast(dict[str, Any], answers[6][0])["candidates"]


def test_the_cluster_answers_are_what_their_schema_types_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recorded Prometheus (four hosts): hosts, devices and the ranking."""
    fleet_file = write_fleet(tmp_path / "fleet.json", [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0}])
    with recorded_prometheus() as url, server_state(fleet_file, tmp_path / "registry",
                                                    monkeypatch) as state:
        monkeypatch.setenv("AUTOGPU_PROMETHEUS_URL", url)
        cluster = payloads.cluster_payload(state.context(), Constraints.parse(min_free="10G"))
        history = payloads.cluster_history_payload(state.context(), 600.0)
    assert cluster["hosts"] and cluster["ranking"][0]["chosen"]
    assert mismatches(wire(cluster), schema.ClusterAnswer) == []
    assert mismatches(wire(history), schema.ClusterHistoryAnswer) == []


def test_the_move_answers_are_what_their_schema_types_say() -> None:
    """Planned (dry run), done, and waiting for the client's restart."""
    dev = SimpleNamespace(uuid=B, label="GPU 1")
    plan: Any = SimpleNamespace(target=(dev,), message="Move to GPU 1 (80.0 GiB free)")
    for answer in (moving.result_payload(plan, None, dry_run=True),
                   moving.result_payload(plan, None, dry_run=False),
                   moving.pending_payload(plan)):
        assert mismatches(wire(answer), schema.MoveAnswer) == []


def test_the_json_core_writes_has_the_schemas_keys() -> None:
    """The answers pass core's own JSON through (a device, the constraints, a cluster host and
    its devices, a host's history): a field added there must be added to the schema."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.cluster.history import HostHistory
    from autogpu_jupyter.core.cluster.series import ClusterDevice, ClusterHost

    snap = SimulatedBackend("demo-4x").snapshot()
    for d in snap.devices:
        assert mismatches(d.to_dict(), schema.DeviceJSON) == []
    assert mismatches(Constraints.parse(min_free="10G", count=2).to_json(),
                      schema.ConstraintsJSON) == []
    host = ClusterHost(hostname="gpu-a", instances=("gpu-a:9100",), state="ok", as_of_s=99.0,
                       scrape_interval_s=60.0,
                       devices=(ClusterDevice(snap.devices[0], "autogpu"),))
    assert mismatches(host.to_dict(), schema.ClusterHostJSON) == []
    history = HostHistory("gpu-a", "autogpu", (1.0, 2.0), (10.0, None), (None, 50.0))
    assert mismatches(history.to_dict(), schema.HostHistoryJSON) == []
