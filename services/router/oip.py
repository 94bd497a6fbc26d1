"""Open Inference Protocol messages to and from the router's domain types."""

import numpy as np
from inference import grpc_predict_v2_pb2 as pb

from services.common import errors
from services.common.tensors import NUMPY_DTYPES, TensorData, pack_bytes_elements
from services.router.core import STANDARD, TIERS, VIP, InferRequest, InferResult, ModelSignature

# The typed `contents` field that carries each datatype (FP16 has none: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def request_from_proto(request: pb.ModelInferRequest, metadata: dict[str, str], timeout_s: float | None) -> InferRequest:
    """Converts a ModelInferRequest; raises InvalidArgument for wire-level faults."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise errors.InvalidArgument(
            f"raw_input_contents has {len(raw)} entries but the request has {len(request.inputs)} inputs; "
            "give one entry per input, in order")
    _refuse_unsupported(request)
    inputs = []
    for i, tensor in enumerate(request.inputs):
        if raw:
            if tensor.HasField("contents") and any(
                    len(getattr(tensor.contents, f.name)) for f in tensor.contents.DESCRIPTOR.fields):
                raise errors.InvalidArgument(
                    f"input {errors.shown(tensor.name)} has both contents and raw_input_contents; use one of them")
            data = raw[i]
        else:
            data = _contents_bytes(tensor)
        inputs.append(TensorData(tensor.name, tensor.datatype, tuple(tensor.shape), data))
    claimed = None  # the tier the request asks for; who may use it is the caller's tenant's to say
    tier_name = metadata.get("x-user-tier")
    if tier_name is not None:
        tier_name = tier_name.lower()
        if tier_name not in TIERS:
            raise errors.InvalidArgument(f"metadata x-user-tier is {errors.shown(tier_name)}; expected one of "
                                         f"{sorted(TIERS)}")
        claimed = TIERS[tier_name]
    if not request.parameters:  # the usual case: none of the checks below applies
        return InferRequest(model=request.model_name, version=request.model_version, id=request.id, inputs=inputs,
                            outputs=[o.name for o in request.outputs], claimed_tier=claimed, timeout_s=timeout_s)
    # The OIP/Triton request parameters: priority (1 is the highest level, 0 the
    # default) and timeout in microseconds, which may only shorten the deadline.
    priority = _int_parameter(request, "priority")
    if priority is not None and priority != 0:
        if priority not in PRIORITY_LEVELS:
            raise errors.InvalidArgument(
                f"parameter 'priority' is {priority}; levels are 1 (VIP) and 2 (standard), 0 for the default")
        claimed = PRIORITY_LEVELS[priority]
    timeout_us = _int_parameter(request, "timeout")
    if timeout_us is not None:
        if timeout_us <= 0:
            raise errors.InvalidArgument(f"parameter 'timeout' is {timeout_us}; give microseconds > 0")
        timeout_s = min(timeout_s, timeout_us / 1e6) if timeout_s is not None else timeout_us / 1e6
    return InferRequest(
        cache_bypass=_bool_parameter(request, "cache_bypass"),
        model=request.model_name,
        version=request.model_version,
        id=request.id,
        inputs=inputs,
        outputs=[o.name for o in request.outputs],
        claimed_tier=claimed,
        timeout_s=timeout_s,
    )


PRIORITY_LEVELS = {1: VIP, 2: STANDARD}
# Parameters of the protocol (and of Triton's extensions, which tritonclient
# sends) whose feature this server does not have: a request that asks for one
# is refused, rather than answered as if it had not asked.
UNSUPPORTED_TENSOR_PARAMETERS = dict.fromkeys(
    ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"),
    "shared-memory tensors are not supported; send the data in the request")
UNSUPPORTED_OUTPUT_PARAMETERS = {
    **UNSUPPORTED_TENSOR_PARAMETERS,
    "classification": "classification outputs (class_count) are not supported; ask for the raw output",
}
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


def _refuse_unsupported(request: pb.ModelInferRequest) -> None:
    for tensor in request.inputs:
        for name in tensor.parameters or ():
            if name in UNSUPPORTED_TENSOR_PARAMETERS:
                raise errors.InvalidArgument(f"input {errors.shown(tensor.name)} has parameter '{name}': "
                                             f"{UNSUPPORTED_TENSOR_PARAMETERS[name]}")
    for output in request.outputs:
        for name in output.parameters or ():
            if name in UNSUPPORTED_OUTPUT_PARAMETERS:
                raise errors.InvalidArgument(f"requested output {errors.shown(output.name)} has parameter '{name}': "
                                             f"{UNSUPPORTED_OUTPUT_PARAMETERS[name]}")
    parameters = request.parameters
    for name in SEQUENCE_PARAMETERS if parameters else ():
        if name in parameters and _parameter_set(parameters[name]):
            raise errors.InvalidArgument(f"parameter '{name}' is set: sequence batching (stateful models) is not "
                                         "supported; send each request on its own")


def _parameter_set(parameter) -> bool:
    """Whether an InferParameter holds anything but its kind's zero value."""
    kind = parameter.WhichOneof("parameter_choice")
    return kind is not None and bool(getattr(parameter, kind))


def _int_parameter(request: pb.ModelInferRequest, name: str) -> int | None:
    if name not in request.parameters:
        return None
    parameter = request.parameters[name]
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise errors.InvalidArgument(f"parameter '{name}' must be an int64_param or uint64_param, got {kind}")
    return getattr(parameter, kind)


def _bool_parameter(request: pb.ModelInferRequest, name: str) -> bool:
    if name not in request.parameters:
        return False
    parameter = request.parameters[name]
    if parameter.WhichOneof("parameter_choice") != "bool_param":
        raise errors.InvalidArgument(
            f"parameter '{name}' must be a bool_param, got {parameter.WhichOneof('parameter_choice')}")
    return parameter.bool_param


def _contents_bytes(tensor) -> bytes:
    datatype = tensor.datatype
    field = CONTENTS_FIELD.get(datatype)
    contents = tensor.contents
    used = [f.name for f in contents.DESCRIPTOR.fields if len(getattr(contents, f.name))]
    if field is None:
        if datatype in NUMPY_DTYPES:
            raise errors.InvalidArgument(f"input {errors.shown(tensor.name)} of datatype {datatype} must use raw_input_contents")
        raise errors.InvalidArgument(f"input {errors.shown(tensor.name)} has unknown datatype {errors.shown(datatype)}")
    wrong = [name for name in used if name != field]
    if wrong:
        raise errors.InvalidArgument(
            f"input {errors.shown(tensor.name)} of datatype {datatype} carries {wrong[0]}; expected {field}")
    values = getattr(contents, field)
    if datatype == "BYTES":
        return pack_bytes_elements(list(values))
    try:
        return np.asarray(values, dtype=NUMPY_DTYPES[datatype]).tobytes()
    except (OverflowError, ValueError) as exc:
        raise errors.InvalidArgument(f"input {errors.shown(tensor.name)} has a value out of range for {datatype}: {exc}") from None


def response_to_proto(result: InferResult) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=result.model, model_version=result.version, id=result.id)
    if result.degraded:  # the model's breaker is open: say what answered instead
        response.parameters["infermesh_degraded"].string_param = result.degraded
    for tensor in result.outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.data)
    return response


def metadata_to_proto(sig: ModelSignature) -> pb.ModelMetadataResponse:
    def specs(items):
        return [pb.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape) for s in items]

    return pb.ModelMetadataResponse(name=sig.name, versions=list(sig.versions), platform=sig.platform,
                                    inputs=specs(sig.inputs), outputs=specs(sig.outputs))
