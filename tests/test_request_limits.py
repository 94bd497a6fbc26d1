"""The router reads a large request without waiting on it: counts checked on the
wire before parsing (precheck), the same rules on every parsed request
(check_counts), BYTES contents walked only as far as their shape, and large
messages decoded off the event loop."""

import asyncio
import concurrent.futures
import contextlib
import struct
import threading

import pytest
from inference import grpc_predict_v2_pb2 as pb

from services.common import errors, serving
from services.common.tensors import check_bytes_elements
from services.common.wire import Reader
from services.router import precheck
from services.router.limits import RequestLimits
from services.router.oip import RequestDecoder, check_counts
from tests.oip import pack_texts, text_request
from tools import fuzz_oip, pathological

pytestmark = pytest.mark.unit

LIMITS = RequestLimits()


@pytest.fixture(scope="module")
def attacks():
    return pathological.all_attacks(scale=0.25)


def refusal(raw: bytes, limits: RequestLimits = LIMITS) -> str:
    with pytest.raises(errors.InvalidArgument) as info:
        RequestDecoder(limits).decode(raw)
    return info.value.message


def test_every_pathological_request_is_refused_naming_its_field(attacks):
    for attack in attacks:
        with pytest.raises(errors.InvalidArgument) as info:
            fuzz_oip.in_process(attack.raw, LIMITS)  # decode, convert, validate: all the router does first
        assert attack.names in info.value.message, (attack.kind, info.value.message)


def test_the_wire_walk_costs_the_limits_not_the_message(attacks):
    """What the precheck visits is bounded by the limits whatever the message
    holds: millions of elements or inputs cost it the fields of max_inputs + 1
    inputs at most (4 each here), against millions to parse."""
    readers = []
    original = Reader.__init__

    def recording(self, buf, budget):
        original(self, buf, budget)
        readers.append((self, budget))

    Reader.__init__ = recording
    try:
        for attack in attacks:
            readers.clear()
            try:
                precheck.check_request(attack.raw, LIMITS)
            except errors.InvalidArgument:
                assert attack.kind in ("empty_bytes_typed", "many_inputs"), attack.kind
            ((reader, budget),) = readers
            assert budget - reader.budget <= 4 * (LIMITS.max_inputs + 1) + 8, (attack.kind, budget - reader.budget)
    finally:
        Reader.__init__ = original


def test_a_request_of_more_fields_than_any_within_the_limits_is_refused_unparsed():
    request = pb.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64])
    tensor.contents.fp32_contents.extend([0.0] * 64)
    raw = request.SerializeToString() + b"\x0a\x00" * 100_000  # model_name given 100,000 times more
    assert "request holds more than" in refusal(raw)


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda r, n: [r.inputs.add(name=f"I{i}", datatype="FP32", shape=[1]) for i in range(n)], "inputs"),
        (lambda r, n: [r.outputs.add(name=f"O{i}") for i in range(n)], "requested outputs"),
        (lambda r, n: [r.parameters[f"p{i}"].__setattr__("int64_param", i) for i in range(n)], "parameters"),
        (lambda r, n: r.raw_input_contents.extend([b""] * n), "raw_input_contents entries"),
    ],
)
def test_counts_at_the_limit_pass_and_one_more_is_refused_on_the_wire_and_parsed(build, fragment):
    """precheck (wire, for large messages) and check_counts (parsed) hold the same rules."""
    limits = RequestLimits(max_inputs=8, max_outputs=8, max_parameters=8)
    for count, refused in ((8, False), (9, True)):
        request = pb.ModelInferRequest(model_name="m", id="x" * 70_000)  # large: the wire is walked first
        build(request, count)
        raw = request.SerializeToString()
        outcomes = []
        checks = (
            lambda raw=raw: precheck.check_request(raw, limits),
            lambda request=request: check_counts(request, limits),
        )
        for check in checks:
            try:
                check()
                outcomes.append(None)
            except errors.InvalidArgument as exc:
                outcomes.append(exc.message)
        assert outcomes[0] == outcomes[1], outcomes
        assert (outcomes[0] is not None) == refused and (not refused or fragment in outcomes[0]), outcomes


def test_packed_varints_are_counted_on_the_wire_one_per_value():
    from services.common import wire

    values = [0, 1, 127, 128, 300, 2**63 - 1, -1]
    payload = pb.InferTensorContents(int64_contents=values).SerializeToString()[2:]  # one packed field, small
    assert wire.packed_varints(payload, 0, len(payload)) == len(values)
    request = pb.ModelInferRequest(model_name="m", id="x" * 70_000)
    request.inputs.add(name="I", datatype="INT64", shape=[3]).contents.int64_contents.extend([2**40] * 4)
    with pytest.raises(errors.InvalidArgument, match="carries more than 3 int64_contents elements"):
        precheck.check_request(request.SerializeToString(), LIMITS)


def test_typed_elements_past_the_shape_or_the_limit_are_refused_before_conversion():
    request = pb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend([0.0] * 65)
    assert "input 'INPUT0' carries more than 64 fp32_contents elements; its shape [1, 64] holds 64" in refusal(
        request.SerializeToString()
    )
    big = pb.ModelInferRequest(model_name="mlp")
    big.inputs.add(name="INPUT0", datatype="FP32", shape=[1100, 64]).contents.fp32_contents.extend([0.0] * 70_400)
    assert "more than 65536 typed contents elements" in refusal(big.SerializeToString())


def test_bytes_contents_are_walked_only_as_far_as_the_shape():
    data = pack_texts(["a", "b"]) + struct.pack("<I", 0) * 1000
    with pytest.raises(errors.InvalidArgument, match=r"holds more than 2 BYTES element\(s\).*4000 byte\(s\) follow"):
        check_bytes_elements(data, (2,), "input 'TEXT'")
    with pytest.raises(errors.InvalidArgument, match=r"element 1 is 5 bytes long; the limit is 4 bytes"):
        check_bytes_elements(pack_texts(["abcd", "abcde"]), (2,), "input 'TEXT'", max_element_bytes=4)
    with pytest.raises(errors.InvalidArgument, match=r"holds 1 BYTES element\(s\) but shape \[3\] needs 3"):
        check_bytes_elements(pack_texts(["a"]), (3,), "input 'TEXT'")
    check_bytes_elements(pack_texts(["abcd", ""]), (2,), "input 'TEXT'", max_element_bytes=4)


def test_a_good_request_decodes_to_raw_contents_whatever_it_was_sent_as():
    typed = pb.ModelInferRequest(model_name="minilm", id="t")
    typed.inputs.add(name="TEXT", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"a", b"bc"])
    decoded = RequestDecoder(LIMITS).decode(typed.SerializeToString())
    assert list(decoded.raw_input_contents) == [pack_texts(["a", "bc"])] and not decoded.inputs[0].HasField("contents")
    raw = text_request(["x" * 100_000])  # large: prechecked, then parsed
    assert RequestDecoder(LIMITS).decode(raw.SerializeToString()) == raw


def test_a_refused_message_keeps_its_model_and_id_for_the_answer(attacks):
    for attack in attacks:
        partial = RequestDecoder(LIMITS).partial(attack.raw)
        assert partial.model_name in ("minilm", "mlp") and partial.id == attack.kind.replace("_", "-")


async def test_a_large_message_is_decoded_while_the_event_loop_goes_on(attacks):
    """The loop keeps running while a pathological request is decoded: it is
    decoded in the server's decode thread, never on the loop."""
    threads = []

    class Recording(RequestDecoder):
        def decode(self, raw):
            threads.append(threading.get_ident())
            return super().decode(raw)

    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        decoding = serving._Decoding(Recording(LIMITS), thread)
        running = asyncio.create_task(ticker())
        for attack in attacks:
            before = ticks
            with contextlib.suppress(errors.InvalidArgument):  # raw contents are judged later, by their shape
                await decoding.decode(attack.raw)
            assert ticks > before, attack.kind
        done.set()
        await running
        small = text_request(["hello"]).SerializeToString()
        await decoding.decode(small)
    assert threading.get_ident() not in threads[:-1] and threads[-1] == threading.get_ident()


def test_typed_values_out_of_range_are_refused_naming_the_input():
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="I", datatype="INT8", shape=[1]).contents.int_contents.append(1000)
    with pytest.raises(errors.InvalidArgument, match="input 'I' has a value out of range for INT8"):
        RequestDecoder(LIMITS).decode(request.SerializeToString())


def test_check_counts_refuses_negative_and_too_many_dimensions():
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="I", datatype="FP32", shape=[-1, 4])
    with pytest.raises(errors.InvalidArgument, match=r"input 'I' has shape \[-1, 4\] with a negative dimension"):
        check_counts(request, LIMITS)
    deep = pb.ModelInferRequest(model_name="m")
    deep.inputs.add(name="I", datatype="FP32", shape=[1] * 33)
    with pytest.raises(errors.InvalidArgument, match="input 'I' has a shape of more than 32 dimensions"):
        check_counts(deep, LIMITS)


def test_fields_are_counted_through_submessages_and_packed_elements():
    from infermesh.batcher.v1 import batcher_pb2
    from infermesh.common.v1.tensor_pb2 import Tensor

    from services.common import wire

    request = batcher_pb2.SubmitRequest(
        id=1, model="mlp", inputs=[Tensor(name="INPUT0", datatype="FP32", shape=[2, 64], data=bytes(512))]
    )
    frame = batcher_pb2.SubmitManyRequest(requests=[request] * 3).SerializeToString()
    # per request: itself, its id, model and inputs, the tensor's name, datatype, shape (the field and 2 elements), data
    assert wire.count_fields(frame, batcher_pb2.SubmitManyRequest.DESCRIPTOR, 100) == 3 * (1 + 3 + 6)
    with pytest.raises(wire.BudgetExceeded):
        wire.count_fields(frame, batcher_pb2.SubmitManyRequest.DESCRIPTOR, 26)
    decoder = serving.BoundedDecoder(batcher_pb2.SubmitManyRequest, 1000, "SubmitMany")
    assert decoder.decode(frame) == batcher_pb2.SubmitManyRequest.FromString(frame)
    with pytest.raises(errors.InvalidArgument, match="SubmitMany message of 200000 bytes holds more than 1000"):
        decoder.decode(b"\x0a\x00" * 100_000)
