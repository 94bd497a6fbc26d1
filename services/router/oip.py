"""Open Inference Protocol messages to and from the router's domain types."""

import numpy as np
from inference import grpc_predict_v2_pb2 as pb

from services.common import errors
from services.common.tensors import NUMPY_DTYPES, TensorData, pack_bytes_elements
from services.router.core import TIERS, InferRequest, InferResult, ModelSignature

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
    inputs = []
    for i, tensor in enumerate(request.inputs):
        has_contents = tensor.HasField("contents") and any(
            len(getattr(tensor.contents, f.name)) for f in tensor.contents.DESCRIPTOR.fields)
        if raw and has_contents:
            raise errors.InvalidArgument(
                f"input '{tensor.name}' has both contents and raw_input_contents; use one of them")
        data = raw[i] if raw else _contents_bytes(tensor)
        inputs.append(TensorData(tensor.name, tensor.datatype, tuple(tensor.shape), data))
    tier_name = metadata.get("x-user-tier", "standard").lower()
    if tier_name not in TIERS:
        raise errors.InvalidArgument(f"metadata x-user-tier is {tier_name!r}; expected one of {sorted(TIERS)}")
    return InferRequest(
        cache_bypass=_bool_parameter(request, "cache_bypass"),
        model=request.model_name,
        version=request.model_version,
        id=request.id,
        inputs=inputs,
        outputs=[o.name for o in request.outputs],
        tier=TIERS[tier_name],
        timeout_s=timeout_s,
    )


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
            raise errors.InvalidArgument(f"input '{tensor.name}' of datatype {datatype} must use raw_input_contents")
        raise errors.InvalidArgument(f"input '{tensor.name}' has unknown datatype {datatype!r}")
    wrong = [name for name in used if name != field]
    if wrong:
        raise errors.InvalidArgument(
            f"input '{tensor.name}' of datatype {datatype} carries {wrong[0]}; expected {field}")
    values = getattr(contents, field)
    if datatype == "BYTES":
        return pack_bytes_elements(list(values))
    try:
        return np.asarray(values, dtype=NUMPY_DTYPES[datatype]).tobytes()
    except (OverflowError, ValueError) as exc:
        raise errors.InvalidArgument(f"input '{tensor.name}' has a value out of range for {datatype}: {exc}") from None


def response_to_proto(result: InferResult) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=result.model, model_version=result.version, id=result.id)
    for tensor in result.outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.data)
    return response


def metadata_to_proto(sig: ModelSignature) -> pb.ModelMetadataResponse:
    def specs(items):
        return [pb.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape) for s in items]

    return pb.ModelMetadataResponse(name=sig.name, versions=list(sig.versions), platform=sig.platform,
                                    inputs=specs(sig.inputs), outputs=specs(sig.outputs))
