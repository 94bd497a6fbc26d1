"""Helpers for tests that speak the Open Inference Protocol with our generated stubs."""

import struct

import numpy as np
from inference import grpc_predict_v2_pb2 as pb


def pack_texts(texts: list[str | bytes]) -> bytes:
    out = b""
    for text in texts:
        data = text.encode() if isinstance(text, str) else text
        out += struct.pack("<I", len(data)) + data
    return out


def text_request(
    texts: list[str | bytes], model: str = "minilm", request_id: str = "", version: str = ""
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(pack_texts(texts))
    return request


def tensor_request(array: np.ndarray, model: str = "mlp", name: str = "INPUT0") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype="FP32", shape=list(array.shape))
    request.raw_input_contents.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return request


def output_array(response: pb.ModelInferResponse, name: str) -> np.ndarray:
    for i, tensor in enumerate(response.outputs):
        if tensor.name == name:
            assert tensor.datatype == "FP32"
            return np.frombuffer(response.raw_output_contents[i], dtype="<f4").reshape(list(tensor.shape))
    raise KeyError(name)
