"""Open Inference Protocol messages to and from the router's domain types."""

import numpy as np
from inference import grpc_predict_v2_pb2 as pb

from services.common import errors
from services.common.tensors import NUMPY_DTYPES, TensorData, element_count, pack_bytes_elements
from services.common.tier import BY_LABEL, Tier
from services.common.tracing import TRACEPARENT
from services.router import limits as rules
from services.router import precheck
from services.router.core import InferRequest, InferResult, ModelSignature
from services.router.limits import MAX_DIMS, RequestLimits

# The typed `contents` field that carries each datatype (FP16 has none: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# A message larger than this is walked on the wire before it is parsed
# (precheck), and decoded in the server's decode thread: smaller ones
# parse in well under a millisecond whatever they hold.
PRECHECK_BYTES = 64 * 1024
# Typed contents are converted a slice at a time, each a short C-level step,
# so that a thread converting many lets the event loop run in between.
CONVERT_CHUNK = 16384


class RequestDecoder:
    """Reads ModelInfer and ModelStreamInfer messages for the server
    (serving.Decoder): the wire checked first when large, then parsed, its
    counts checked (check_counts), and typed contents converted to raw ones,
    so that what follows on the event loop only slices bytes."""

    def __init__(self, limits: RequestLimits):
        self.limits = limits

    def decode(self, raw: bytes) -> pb.ModelInferRequest:
        if len(raw) > PRECHECK_BYTES:
            precheck.check_request(raw, self.limits)
        request = pb.ModelInferRequest.FromString(raw)
        check_counts(request, self.limits)
        move_contents_to_raw(request)
        return request

    def partial(self, raw: bytes) -> pb.ModelInferRequest:
        """What a refusal's answer names: the request's model, version and id."""
        model, version, request_id = precheck.header(raw)
        return pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)


def check_counts(request: pb.ModelInferRequest, limits: RequestLimits) -> None:
    """The rules of precheck.check_request, on a parsed request and with the
    same refusals: every repeated field within what its shapes and `limits`
    allow. Costs a len() per field."""
    if len(request.parameters) > limits.max_parameters:
        raise rules.too_many("parameters", limits.max_parameters, "max_parameters")
    if len(request.inputs) > limits.max_inputs:
        raise rules.too_many("inputs", limits.max_inputs, "max_inputs")
    typed = 0
    for tensor in request.inputs:
        if len(tensor.shape) > MAX_DIMS:
            raise rules.too_many_dims(tensor.name)
        if len(tensor.parameters) > limits.max_parameters:
            raise rules.too_many_parameters(f"input {errors.shown(tensor.name)}", limits.max_parameters)
        if any(d < 0 for d in tensor.shape):
            raise rules.negative_dimension(tensor.name, tensor.shape)
        if tensor.HasField("contents"):
            allowed = element_count(tensor.shape)
            for field in rules.CONTENTS_FIELDS.values():
                found = len(getattr(tensor.contents, field))
                if found > allowed:
                    raise rules.too_many_elements(tensor.name, field, tensor.shape, allowed)
                typed += found
            if typed > limits.max_typed_elements:
                raise rules.too_many_typed(limits.max_typed_elements)
    if len(request.outputs) > limits.max_outputs:
        raise rules.too_many("requested outputs", limits.max_outputs, "max_outputs")
    for output in request.outputs:
        if len(output.parameters) > limits.max_parameters:
            raise rules.too_many_parameters(f"requested output {errors.shown(output.name)}", limits.max_parameters)
    if len(request.raw_input_contents) > limits.max_inputs:
        raise rules.too_many("raw_input_contents entries", limits.max_inputs, "max_inputs")


def move_contents_to_raw(request: pb.ModelInferRequest) -> None:
    """Converts typed contents into raw_input_contents in place, as
    request_from_proto would, refusing as it does; a request with raw
    contents, or without typed ones, is left for it to judge."""
    if request.raw_input_contents or not any(tensor.HasField("contents") for tensor in request.inputs):
        return
    packed = [_contents_bytes(tensor) for tensor in request.inputs]
    for tensor in request.inputs:
        tensor.ClearField("contents")
    request.raw_input_contents.extend(packed)


def request_from_proto(
    request: pb.ModelInferRequest, metadata: dict[str, str], timeout_s: float | None
) -> InferRequest:
    """Converts a ModelInferRequest; raises InvalidArgument for wire-level faults."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise errors.InvalidArgument(
            f"raw_input_contents has {len(raw)} entries but the request has {len(request.inputs)} inputs; "
            "give one entry per input, in order"
        )
    _refuse_unsupported(request)
    inputs = []
    for i, tensor in enumerate(request.inputs):
        if raw:
            if tensor.HasField("contents") and any(
                len(getattr(tensor.contents, f.name)) for f in tensor.contents.DESCRIPTOR.fields
            ):
                raise errors.InvalidArgument(
                    f"input {errors.shown(tensor.name)} has both contents and raw_input_contents; use one of them"
                )
            data = raw[i]
        else:
            data = _contents_bytes(tensor)
        inputs.append(TensorData(tensor.name, tensor.datatype, tuple(tensor.shape), data))
    claimed = None  # the tier the request asks for; who may use it is the caller's tenant's to say
    header = metadata.get("x-user-tier")
    if header is not None:
        claimed = BY_LABEL.get(header.lower())
        if claimed is None:
            raise errors.InvalidArgument(
                f"metadata x-user-tier is {errors.shown(header.lower())}; expected one of {sorted(BY_LABEL)}"
            )
    if not request.parameters:  # the usual case: none of the checks below applies
        return InferRequest(
            model=request.model_name,
            version=request.model_version,
            id=request.id,
            inputs=inputs,
            outputs=[o.name for o in request.outputs],
            claimed_tier=claimed,
            timeout_s=timeout_s,
            traceparent=metadata.get(TRACEPARENT, ""),
        )
    # The OIP/Triton request parameters: priority (1 is the highest, 0 the
    # default), converted to a Tier here and nowhere else, and timeout in
    # microseconds, which may only shorten the deadline.
    priority = _int_parameter(request, "priority")
    if priority is not None and priority != 0:
        if priority not in OIP_PRIORITY_TIERS:
            raise errors.InvalidArgument(
                f"parameter 'priority' is {priority}; levels are 1 (VIP) and 2 (standard), 0 for the default"
            )
        claimed = OIP_PRIORITY_TIERS[priority]
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
        traceparent=metadata.get(TRACEPARENT, ""),
    )


OIP_PRIORITY_TIERS = {1: Tier.VIP, 2: Tier.STANDARD}  # the public protocol's priority values
# Parameters of the protocol (and of Triton's extensions, which tritonclient
# sends) whose feature this server does not have: a request that asks for one
# is refused, rather than answered as if it had not asked.
UNSUPPORTED_TENSOR_PARAMETERS = dict.fromkeys(
    ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"),
    "shared-memory tensors are not supported; send the data in the request",
)
UNSUPPORTED_OUTPUT_PARAMETERS = {
    **UNSUPPORTED_TENSOR_PARAMETERS,
    "classification": "classification outputs (class_count) are not supported; ask for the raw output",
}
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


def _refuse_unsupported(request: pb.ModelInferRequest) -> None:
    for tensor in request.inputs:
        for name in tensor.parameters or ():
            if name in UNSUPPORTED_TENSOR_PARAMETERS:
                raise errors.InvalidArgument(
                    f"input {errors.shown(tensor.name)} has parameter '{name}': {UNSUPPORTED_TENSOR_PARAMETERS[name]}"
                )
    for output in request.outputs:
        for name in output.parameters or ():
            if name in UNSUPPORTED_OUTPUT_PARAMETERS:
                raise errors.InvalidArgument(
                    f"requested output {errors.shown(output.name)} has parameter '{name}': "
                    f"{UNSUPPORTED_OUTPUT_PARAMETERS[name]}"
                )
    parameters = request.parameters
    for name in SEQUENCE_PARAMETERS if parameters else ():
        if name in parameters and _parameter_set(parameters[name]):
            raise errors.InvalidArgument(
                f"parameter '{name}' is set: sequence batching (stateful models) is not "
                "supported; send each request on its own"
            )


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
            f"parameter '{name}' must be a bool_param, got {parameter.WhichOneof('parameter_choice')}"
        )
    return parameter.bool_param


def _contents_bytes(tensor) -> bytes:
    datatype = tensor.datatype
    field = CONTENTS_FIELD.get(datatype)
    contents = tensor.contents
    used = [f.name for f in contents.DESCRIPTOR.fields if len(getattr(contents, f.name))]
    if field is None:
        if datatype in NUMPY_DTYPES:
            raise errors.InvalidArgument(
                f"input {errors.shown(tensor.name)} of datatype {datatype} must use raw_input_contents"
            )
        raise errors.InvalidArgument(f"input {errors.shown(tensor.name)} has unknown datatype {errors.shown(datatype)}")
    wrong = [name for name in used if name != field]
    if wrong:
        raise errors.InvalidArgument(
            f"input {errors.shown(tensor.name)} of datatype {datatype} carries {wrong[0]}; expected {field}"
        )
    values = getattr(contents, field)
    count = element_count(tensor.shape)
    if len(values) != count:
        raise errors.InvalidArgument(
            f"input {errors.shown(tensor.name)} holds {len(values)} {field} element(s) but "
            f"shape {list(tensor.shape)} needs {count}"
        )
    if datatype == "BYTES":
        return pack_bytes_elements(values[:])
    dtype = NUMPY_DTYPES[datatype]
    try:
        if len(values) <= CONVERT_CHUNK:
            return np.asarray(values, dtype=dtype).tobytes()
        return b"".join(
            np.asarray(values[start : start + CONVERT_CHUNK], dtype=dtype).tobytes()
            for start in range(0, len(values), CONVERT_CHUNK)
        )
    except (OverflowError, ValueError) as exc:
        raise errors.InvalidArgument(
            f"input {errors.shown(tensor.name)} has a value out of range for {datatype}: {exc}"
        ) from None


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

    return pb.ModelMetadataResponse(
        name=sig.name,
        versions=list(sig.versions),
        platform=sig.platform,
        inputs=specs(sig.inputs),
        outputs=specs(sig.outputs),
    )
