"""The generated messages: fresh, exactly upstream's fields, and byte-compatible with upstream's copy.

The expected table is written out from docs/clusterd.md#messages-and-field-numbers (plus
RecoverStrategyRequest), not read from any .proto, so an edit to the proto that drifts from
ClusterD fails here even when the gencode was regenerated.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pool, json_format
from google.protobuf.descriptor import FieldDescriptor

from nicswitch_agent._pb import _stamp
from nicswitch_agent._pb import recover_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto/nicswitch_agent/_pb/recover.proto"
GENCODE = ROOT / "src/nicswitch_agent/_pb/recover_pb2.py"
UPSTREAM_DIR = Path(__file__).resolve().parent / "interop/upstream"

T = FieldDescriptor
STRING, BOOL, INT32, INT64, MESSAGE = T.TYPE_STRING, T.TYPE_BOOL, T.TYPE_INT32, T.TYPE_INT64, T.TYPE_MESSAGE

# message -> [(field name, number, type, repeated, message type name or None)]
EXPECTED: dict[str, list[tuple[str, int, int, bool, str | None]]] = {
    "Status": [("code", 1, INT32, False, None), ("info", 2, STRING, False, None)],
    "ClientInfo": [("jobId", 1, STRING, False, None), ("role", 2, STRING, False, None)],
    "SwitchNics": [("jobID", 1, STRING, False, None), ("nicOps", 2, MESSAGE, True, "SwitchNics.NicOpsEntry")],
    "DeviceList": [("dev", 1, STRING, True, None), ("op", 2, BOOL, True, None)],
    "SwitchRankList": [("rankID", 1, STRING, True, None), ("op", 2, BOOL, True, None),
                       ("jobId", 3, STRING, False, None)],
    "SwitchResult": [("jobId", 1, STRING, False, None), ("result", 2, BOOL, False, None)],
    "SwitchNicRequest": [("jobID", 1, STRING, False, None)],
    "SwitchNicResponse": [("jobID", 1, STRING, False, None), ("msg", 2, STRING, False, None)],
    "ProcessManageSignal": [
        ("uuid", 1, STRING, False, None), ("jobId", 2, STRING, False, None),
        ("signalType", 3, STRING, False, None), ("actions", 4, STRING, True, None),
        ("faultRanks", 5, MESSAGE, True, "FaultRank"), ("changeStrategy", 6, STRING, False, None),
        ("timeout", 7, INT64, False, None), ("nodeRankIds", 8, STRING, True, None),
        ("extraParams", 9, STRING, False, None),
    ],
    "FaultRank": [("rankId", 1, STRING, False, None), ("faultType", 2, STRING, False, None)],
    "StopCompleteRequest": [("jobId", 1, STRING, False, None), ("status", 2, MESSAGE, False, "Status"),
                            ("faultRanks", 3, MESSAGE, True, "FaultRank")],
    "RecoverStatusRequest": [("jobId", 1, STRING, False, None), ("status", 2, MESSAGE, False, "Status"),
                             ("strategy", 3, STRING, False, None), ("isolateRankIds", 4, STRING, True, None)],
    "RecoverStrategyRequest": [("jobId", 1, STRING, False, None), ("faultRanks", 2, MESSAGE, True, "FaultRank"),
                               ("strategies", 3, STRING, True, None)],
}

# One sample per message with every field set to a non-default value.
SAMPLES: dict[str, dict[str, Any]] = {
    "Status": {"code": 413, "info": "dev and op length is not equal"},
    "ClientInfo": {"jobId": "3f2a-uid", "role": "taskd"},
    "SwitchNics": {"jobID": "3f2a-uid", "nicOps": {
        "node-a": {"dev": ["0", "3"], "op": [True, False]},
        "node-b": {"dev": ["7"], "op": [True]},
    }},
    "DeviceList": {"dev": ["0", "1", "15"], "op": [True, False, True]},
    "SwitchRankList": {"rankID": ["16", "0", "31"], "op": [True, False, True], "jobId": "3f2a-uid"},
    "SwitchResult": {"jobId": "3f2a-uid", "result": True},
    "SwitchNicRequest": {"jobID": "3f2a-uid"},
    "SwitchNicResponse": {"jobID": "3f2a-uid", "msg": "switch nic success"},
    "ProcessManageSignal": {
        "uuid": "c0ffee", "jobId": "3f2a-uid", "signalType": "change_strategy", "actions": ["pause_train", "x"],
        "faultRanks": [{"rankId": "3", "faultType": "0"}, {"rankId": "9", "faultType": "1"}],
        "changeStrategy": "retry", "timeout": str(2**40 + 7), "nodeRankIds": ["0", "1"], "extraParams": "{}",
    },
    "FaultRank": {"rankId": "12", "faultType": "1"},
    "StopCompleteRequest": {"jobId": "3f2a-uid", "status": {"code": 7, "info": "ok"},
                            "faultRanks": [{"rankId": "1", "faultType": "0"}]},
    "RecoverStatusRequest": {"jobId": "3f2a-uid", "status": {"code": 502, "info": "bad"}, "strategy": "dump",
                             "isolateRankIds": ["4", "5"]},
    "RecoverStrategyRequest": {"jobId": "3f2a-uid", "faultRanks": [{"rankId": "2", "faultType": "1"}],
                               "strategies": ["retry", "dump", "exit"]},
}


def _repeated(field: FieldDescriptor) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.29; older runtimes only have label
    if is_repeated is not None:
        return bool(is_repeated)
    return bool(getattr(field, "label") == FieldDescriptor.LABEL_REPEATED)  # noqa: B009 - absent on 7.x


def _relative(descriptor: Any, package: str) -> str:
    full_name = str(descriptor.full_name)
    return full_name[len(package) + 1:] if package else full_name


def _table(message: Any, package: str) -> list[tuple[str, int, int, bool, str | None]]:
    return [
        (f.name, f.number, f.type, _repeated(f), _relative(f.message_type, package) if f.message_type else None)
        for f in message.fields
    ]


@pytest.fixture(scope="module")
def upstream() -> ModuleType:
    """The package-less upstream gencode, imported beside ours (top-level module ``recover_pb2``)."""
    sys.path.insert(0, str(UPSTREAM_DIR))
    try:
        module = importlib.import_module("recover_pb2")
    finally:
        sys.path.remove(str(UPSTREAM_DIR))
    assert Path(module.__file__ or "").resolve().parent == UPSTREAM_DIR
    return module


# -- freshness ----------------------------------------------------------------------------------


def test_stamp_matches_the_proto() -> None:
    digest = hashlib.sha256(PROTO.read_bytes()).hexdigest()
    assert digest == _stamp.PROTO_SHA256, (
        f"{PROTO.relative_to(ROOT)} changed since its gencode was made (stamp {_stamp.PROTO_SHA256[:12]}, "
        f"proto {digest[:12]}): run scripts/gen_proto.py in tox -e proto and commit the result"
    )


def test_stamp_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("_gen_proto_under_test", ROOT / "scripts/gen_proto.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stamp_file = ROOT / "src/nicswitch_agent/_pb/_stamp.py"
    assert stamp_file.read_text() == gen.stamp_text(), "run scripts/gen_proto.py in tox -e proto"
    assert _stamp.GENERATOR == gen.GENERATOR == "grpcio-tools==1.62.3"


def test_gencode_has_no_runtime_version_check() -> None:
    # Gencode from newer generators calls runtime_version.ValidateProtobufRuntimeVersion and refuses
    # older runtimes; ours must import on protobuf 4.25 through 7.x.
    text = GENCODE.read_text()
    assert "runtime_version" not in text
    assert "# Protobuf Python Version: 4.25" in text


def test_gencode_is_built_from_our_proto_file() -> None:
    assert pb.DESCRIPTOR.name == "nicswitch_agent/_pb/recover.proto"
    assert "package nicswitch_agent.v1;" in PROTO.read_text()


# -- shape --------------------------------------------------------------------------------------


def test_our_package() -> None:
    assert pb.DESCRIPTOR.package == "nicswitch_agent.v1"
    assert pb.SwitchRankList.DESCRIPTOR.full_name == "nicswitch_agent.v1.SwitchRankList"
    # messages only: stubs would call /nicswitch_agent.v1.Recover/..., which ClusterD does not serve
    assert not pb.DESCRIPTOR.services_by_name


def test_exactly_the_expected_messages() -> None:
    assert set(pb.DESCRIPTOR.message_types_by_name) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fields_match_upstream_table(name: str) -> None:
    descriptor = pb.DESCRIPTOR.message_types_by_name[name]
    assert _table(descriptor, pb.DESCRIPTOR.package) == EXPECTED[name]
    for field in descriptor.fields:
        # proto3 implicit presence like upstream: no `optional`, no oneofs
        assert field.containing_oneof is None
        if field.type != MESSAGE and not _repeated(field):
            assert not field.has_presence, f"{name}.{field.name} must not be `optional`"


def test_nic_ops_is_a_string_to_device_list_map() -> None:
    entry = pb.SwitchNics.DESCRIPTOR.fields_by_name["nicOps"].message_type
    assert entry is not None
    assert entry.GetOptions().map_entry
    assert _table(entry, pb.DESCRIPTOR.package) == [
        ("key", 1, STRING, False, None), ("value", 2, MESSAGE, False, "DeviceList"),
    ]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_upstream_copy_has_the_same_fields(upstream: ModuleType, name: str) -> None:
    assert upstream.DESCRIPTOR.package == ""
    descriptor = upstream.DESCRIPTOR.message_types_by_name[name]
    assert _table(descriptor, "") == EXPECTED[name]


def test_upstream_copy_has_no_other_messages(upstream: ModuleType) -> None:
    assert set(upstream.DESCRIPTOR.message_types_by_name) == set(EXPECTED)


# -- wire compatibility -------------------------------------------------------------------------


def test_samples_cover_every_field() -> None:
    assert set(SAMPLES) == set(EXPECTED)
    for name, sample in SAMPLES.items():
        assert set(sample) == {f[0] for f in EXPECTED[name]}, name


def _build(cls: Any, name: str) -> Any:
    return json_format.ParseDict(SAMPLES[name], cls())


def _as_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ours_parses_as_upstream(upstream: ModuleType, name: str) -> None:
    ours = _build(getattr(pb, name), name)
    theirs = getattr(upstream, name).FromString(ours.SerializeToString())
    assert _as_dict(theirs) == SAMPLES[name]  # every field known and equal (unknown fields are not in dicts)
    assert theirs.SerializeToString(deterministic=True) == ours.SerializeToString(deterministic=True)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_upstream_parses_as_ours(upstream: ModuleType, name: str) -> None:
    theirs = _build(getattr(upstream, name), name)
    ours = getattr(pb, name).FromString(theirs.SerializeToString())
    assert _as_dict(ours) == SAMPLES[name]
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)


def test_switch_rank_list_attribute_round_trip(upstream: ModuleType) -> None:
    sent = upstream.SwitchRankList(rankID=["3", "1", "2"], op=[False, True, True], jobId="j")
    got = pb.SwitchRankList.FromString(sent.SerializeToString())
    assert (list(got.rankID), list(got.op), got.jobId) == (["3", "1", "2"], [False, True, True], "j")
    back = upstream.SwitchResult.FromString(pb.SwitchResult(jobId="j", result=True).SerializeToString())
    assert (back.jobId, back.result) == ("j", True)


def test_default_values_are_absent_on_the_wire(upstream: ModuleType) -> None:
    # ClusterD reads Status.code 0 as success; proto3 leaves it off the wire, and both sides agree.
    assert pb.Status(code=0, info="").SerializeToString() == b""
    assert upstream.Status.FromString(pb.Status(code=0, info="ok").SerializeToString()).code == 0


def test_both_descriptor_sets_coexist(upstream: ModuleType) -> None:
    pool = descriptor_pool.Default()
    for name in EXPECTED:
        ours = pool.FindMessageTypeByName(f"nicswitch_agent.v1.{name}")
        theirs = pool.FindMessageTypeByName(name)
        assert ours is getattr(pb, name).DESCRIPTOR
        assert theirs is getattr(upstream, name).DESCRIPTOR
        assert ours is not theirs
    assert pool.FindFileByName("nicswitch_agent/_pb/recover.proto") is pb.DESCRIPTOR
    assert pool.FindFileByName("recover.proto") is upstream.DESCRIPTOR
