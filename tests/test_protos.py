"""The protos: generated stubs match them, and the public API is wire-compatible
with the published Open Inference Protocol as tritonclient ships it."""

import filecmp
import pathlib
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from tools.gen_stubs import generate

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.unit
def test_generated_stubs_match_the_protos(tmp_path):
    generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(ROOT / "gen") for p in (ROOT / "gen").rglob("*") if p.is_file() and p.suffix in (".py", ".pyi")
    )
    assert fresh == committed, "gen/ holds other files than the protos produce: run 'make stubs'"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, ROOT / "gen" / p, shallow=False)]
    assert not stale, f"gen/ is stale for {stale}: run 'make stubs'"


def _fields(file_proto: descriptor_pb2.FileDescriptorProto) -> dict[str, tuple]:
    """Every field of every message, nested ones included, by full name."""
    found = {}

    def walk(prefix, messages):
        for message in messages:
            name = f"{prefix}.{message.name}"
            for field in message.field:
                found[f"{name}.{field.name}"] = (field.number, field.type, field.label, field.type_name)
            walk(name, message.nested_type)

    walk(file_proto.package, file_proto.message_type)
    return found


def _methods(file_proto) -> dict[str, tuple]:
    return {
        f"{service.name}.{m.name}": (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
        for service in file_proto.service
        for m in service.method
    }


@pytest.mark.service
def test_public_api_is_wire_compatible_with_tritonclient():
    from inference import grpc_predict_v2_pb2 as ours

    ours_proto = descriptor_pb2.FileDescriptorProto.FromString(ours.DESCRIPTOR.serialized_pb)
    # tritonclient's module defines the same message names, so it is read in a
    # separate process: one descriptor pool cannot hold both.
    theirs_bytes = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tritonclient.grpc import service_pb2 as s; sys.stdout.buffer.write(s.DESCRIPTOR.serialized_pb)",
        ],
        check=True,
        capture_output=True,
    ).stdout
    theirs_proto = descriptor_pb2.FileDescriptorProto.FromString(theirs_bytes)
    assert ours_proto.package == theirs_proto.package == "inference"
    ours_fields, theirs_fields = _fields(ours_proto), _fields(theirs_proto)
    assert len(ours_fields) > 40
    for name, signature in ours_fields.items():
        assert theirs_fields.get(name) == signature, f"{name}: ours {signature}, tritonclient {theirs_fields.get(name)}"
    ours_methods, theirs_methods = _methods(ours_proto), _methods(theirs_proto)
    assert len(ours_methods) == 10
    for name, signature in ours_methods.items():
        assert theirs_methods.get(name) == signature, (
            f"{name}: ours {signature}, tritonclient {theirs_methods.get(name)}"
        )
