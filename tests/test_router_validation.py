"""The router's edge validation: every malformed request is INVALID_ARGUMENT or
NOT_FOUND with a message naming the field and the value."""

import re

import numpy as np
import pytest
from inference import grpc_predict_v2_pb2 as pb

from services.common import errors
from services.common.tensors import TensorData
from services.router.core import Catalog, InferRequest, ModelSignature, Router, Spec, request_digest, validate
from services.router.oip import request_from_proto
from services.router.server import _stream_error
from tests.oip import pack_texts, tensor_request, text_request

pytestmark = pytest.mark.unit

MINILM = ModelSignature(
    "minilm",
    ("1",),
    ("1",),
    "onnxruntime_onnx",
    (Spec("TEXT", "BYTES", (-1,)),),
    (Spec("EMBEDDING", "FP32", (-1, 384)),),
    64,
)
MLP = ModelSignature(
    "mlp",
    ("2", "1"),
    ("2", "1"),
    "onnxruntime_onnx",
    (Spec("INPUT0", "FP32", (-1, 64)),),
    (Spec("OUTPUT0", "FP32", (-1, 64)),),
    256,
)


def convert(message: pb.ModelInferRequest, metadata=None) -> InferRequest:
    return request_from_proto(message, metadata or {}, None)


def check(message: pb.ModelInferRequest, sig=MLP):
    return validate(sig, convert(message))


def test_a_good_tensor_request_passes():
    (tensor,) = check(tensor_request(np.zeros((3, 64), np.float32)))
    assert tensor.shape == (3, 64) and len(tensor.data) == 3 * 64 * 4


def test_typed_contents_are_accepted_like_raw_contents():
    message = pb.ModelInferRequest(model_name="mlp")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend([0.5] * 64)
    (tensor,) = check(message)
    assert tensor.data == np.full(64, 0.5, "<f4").tobytes()
    text = pb.ModelInferRequest(model_name="minilm")
    text.inputs.add(name="TEXT", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"a", "é".encode()])
    assert check(text, MINILM)[0].data == pack_texts(["a", "é"])


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (
            lambda m: setattr(m.inputs[0], "datatype", "FP64"),
            "input 'INPUT0' of model 'mlp' has datatype 'FP64'; expected FP32",
        ),
        (lambda m: m.inputs[0].shape.__setitem__(1, 65), "has shape [2, 65]; dimension 1 must be 64"),
        (lambda m: m.inputs[0].shape.append(1), "has shape [2, 64, 1]; expected 2 dimension(s)"),
        (lambda m: m.inputs[0].shape.__setitem__(0, -2), "has shape [-2, 64] with a negative dimension"),
        (lambda m: m.inputs[0].shape.__setitem__(0, 0), "the batch dimension is 0"),
        (lambda m: m.inputs[0].shape.__setitem__(0, 3), "has 512 bytes of data but shape [3, 64] of FP32 needs 768"),
        (lambda m: setattr(m.inputs[0], "name", "INPUT9"), "unexpected input(s) ['INPUT9'] for model 'mlp'"),
        (lambda m: m.outputs.add(name="NOPE"), "requested output(s) ['NOPE'] do not exist in model 'mlp'"),
    ],
)
def test_bad_tensor_requests_name_field_and_value(mutate, fragment):
    message = tensor_request(np.zeros((2, 64), np.float32))
    mutate(message)
    with pytest.raises(errors.InvalidArgument) as info:
        check(message)
    assert fragment in info.value.message


def test_missing_input():
    with pytest.raises(errors.InvalidArgument, match=r"missing input\(s\) \['INPUT0'\] for model 'mlp'"):
        check(pb.ModelInferRequest(model_name="mlp"))


def test_batch_over_max_batch_size():
    with pytest.raises(errors.InvalidArgument, match="batch of 300 exceeds max_batch_size 256"):
        check(tensor_request(np.zeros((300, 64), np.float32)))


def test_both_contents_and_raw_contents():
    message = tensor_request(np.zeros((1, 64), np.float32))
    message.inputs[0].contents.fp32_contents.extend([0.0] * 64)
    with pytest.raises(errors.InvalidArgument, match="input 'INPUT0' has both contents and raw_input_contents"):
        convert(message)


def test_raw_contents_count_must_match_inputs():
    message = tensor_request(np.zeros((1, 64), np.float32))
    message.raw_input_contents.append(b"")
    with pytest.raises(errors.InvalidArgument, match="raw_input_contents has 2 entries but the request has 1 inputs"):
        convert(message)


def test_wrong_typed_contents_field():
    message = pb.ModelInferRequest(model_name="mlp")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2]).contents.int64_contents.extend([1, 2])
    with pytest.raises(errors.InvalidArgument, match="datatype FP32 carries int64_contents; expected fp32_contents"):
        convert(message)


def test_malformed_bytes_length_prefix():
    message = text_request(["hello"])
    message.raw_input_contents[0] = b"\x09\x00\x00\x00hello"
    with pytest.raises(errors.InvalidArgument, match="input 'TEXT' of model 'minilm': malformed BYTES contents"):
        check(message, MINILM)


def test_bytes_element_count_must_match_shape():
    message = text_request(["a", "b"])
    message.inputs[0].shape[0] = 3
    with pytest.raises(errors.InvalidArgument, match=r"holds 2 BYTES element\(s\) but shape \[3\] needs 3"):
        check(message, MINILM)


def test_unknown_tier():
    with pytest.raises(errors.InvalidArgument, match="x-user-tier is 'gold'"):
        convert(text_request(["a"]), {"x-user-tier": "gold"})


def test_a_tier_in_the_request_is_only_a_claim():
    request = convert(text_request(["a"]), {"x-user-tier": "VIP"})
    assert request.claimed_tier == 1 and request.tier == 0  # its tenant decides (services/router/tenants.py)
    assert convert(text_request(["a"])).claimed_tier is None


def router_with(*signatures) -> Router:
    catalog = Catalog()
    catalog.replace(list(signatures))
    return Router(catalog, batcher=None, cache=None)


def test_unknown_model_and_version_are_not_found():
    router = router_with(MLP)
    with pytest.raises(errors.NotFound, match=r"model 'bert' is not served; available models: \['mlp'\]"):
        router.signature("bert")
    with pytest.raises(errors.NotFound, match=r"model 'mlp' has no version '7'; versions: \['2', '1'\]"):
        router.signature("mlp", "7")
    assert router.signature("mlp") == (MLP, "2")


async def test_a_model_whose_replicas_vanished_is_unavailable_not_unknown():
    router = router_with(MLP)
    router.catalog.replace([])
    request = convert(tensor_request(np.zeros((1, 64), np.float32)))
    with pytest.raises(errors.Unavailable, match="model 'mlp' version '2' has no ready replica"):
        await router.infer(request)


def test_digest_depends_on_every_input_byte_version_and_outputs():
    a = [TensorData("X", "FP32", (1, 1), b"\0\0\0\0")]
    b = [TensorData("X", "FP32", (1, 1), b"\0\0\0\1")]
    base = request_digest("m", "1", a, [])
    assert len(base) == 16
    assert base == request_digest("m", "1", list(a), [])
    assert (
        len(
            {
                base,
                request_digest("m", "1", b, []),
                request_digest("m", "2", a, []),
                request_digest("m", "1", a, ["Y"]),
                request_digest("n", "1", a, []),
                request_digest("m", "1", a, [], revision="5e1f"),
            }
        )
        == 6
    )  # a version replaced in place


def test_typed_contents_out_of_range_for_the_datatype():
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="X", datatype="INT8", shape=[1]).contents.int_contents.append(300)
    with pytest.raises(errors.InvalidArgument, match="input 'X' has a value out of range for INT8"):
        convert(message)


def test_oip_priority_and_timeout_parameters():
    message = text_request(["a"])
    message.parameters["priority"].int64_param = 1
    message.parameters["timeout"].uint64_param = 250_000
    request = convert(message)
    assert request.claimed_tier == 1 and request.timeout_s == 0.25
    message.parameters["priority"].uint64_param = 2
    assert request_from_proto(message, {"x-user-tier": "vip"}, 0.1).claimed_tier == 0  # the parameter wins
    assert request_from_proto(message, {}, 0.1).timeout_s == 0.1  # a timeout only shortens the deadline
    message.parameters["priority"].int64_param = 7
    with pytest.raises(errors.InvalidArgument, match="parameter 'priority' is 7; levels are 1 \\(VIP\\) and 2"):
        convert(message)
    message.parameters["priority"].int64_param = 0
    message.parameters["timeout"].int64_param = -5
    with pytest.raises(errors.InvalidArgument, match="parameter 'timeout' is -5"):
        convert(message)
    message.parameters["timeout"].string_param = "1s"
    with pytest.raises(errors.InvalidArgument, match="parameter 'timeout' must be an int64_param or uint64_param"):
        convert(message)


def _classification(message):
    message.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 2


def _shared_memory_input(message):
    message.inputs[0].parameters["shared_memory_region"].string_param = "input0_region"


def _shared_memory_output(message):
    message.outputs.add(name="OUTPUT0").parameters["shared_memory_byte_size"].int64_param = 256


def _sequence(message):
    message.parameters["sequence_id"].int64_param = 42


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (_classification, "requested output 'OUTPUT0' has parameter 'classification': classification outputs"),
        (_shared_memory_input, "input 'INPUT0' has parameter 'shared_memory_region': shared-memory tensors"),
        (_shared_memory_output, "requested output 'OUTPUT0' has parameter 'shared_memory_byte_size'"),
        (_sequence, "parameter 'sequence_id' is set: sequence batching"),
    ],
)
def test_a_feature_this_server_lacks_is_refused_not_ignored(mutate, fragment):
    """tritonclient asks for these (class_count, shared memory, sequences);
    answering as if it had not would hand the caller something else."""
    message = tensor_request(np.zeros((1, 64), np.float32))
    mutate(message)
    with pytest.raises(errors.InvalidArgument, match=re.escape(fragment)):
        convert(message)
    message = tensor_request(np.zeros((1, 64), np.float32))
    message.parameters["sequence_id"].int64_param = 0  # tritonclient's default: no sequence
    assert convert(message).inputs


def test_values_echoed_in_messages_are_cut_short():
    message = tensor_request(np.zeros((1, 64), np.float32))
    message.inputs[0].datatype = "F" * 10_000
    with pytest.raises(errors.InvalidArgument) as info:
        check(message)
    assert "(10000 characters)" in info.value.message and len(info.value.message) < 400
    many = tensor_request(np.zeros((1, 64), np.float32))
    many.outputs.extend(pb.ModelInferRequest.InferRequestedOutputTensor(name=f"NOPE{i}") for i in range(100))
    with pytest.raises(errors.InvalidArgument, match=r"'NOPE7', and 92 more\]"):
        check(many)


def test_a_refusal_on_a_stream_carries_its_retry_hint_and_the_request_id():
    """A unary refusal's hint is a trailer; a stream has one per message, so it travels as a parameter."""
    response = _stream_error(
        text_request(["x"], request_id="r-9"),
        errors.ResourceExhausted("the standard queue is full", retry_after_ms=120),
    )
    assert response.error_message == "RESOURCE_EXHAUSTED: the standard queue is full"
    assert response.infer_response.id == "r-9"
    assert response.infer_response.parameters["grpc_status"].string_param == "RESOURCE_EXHAUSTED"
    assert response.infer_response.parameters["retry_after_ms"].int64_param == 120
