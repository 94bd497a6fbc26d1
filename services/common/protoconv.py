"""Conversions between the shared internal protos and the domain types."""

from typing import cast

from infermesh.common.v1 import tensor_pb2

from services.common.errors import InfermeshError
from services.common.tensors import TensorData
from services.common.tier import Tier


def tier_to_proto(tier: Tier) -> tensor_pb2.Tier:
    """The wire value of a tier: the same number, as Tier's values are the proto enum's."""
    return cast(tensor_pb2.Tier, tier)


def tensor_to_proto(tensor: TensorData) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape, data=tensor.data)


def tensor_from_proto(message: tensor_pb2.Tensor) -> TensorData:
    return TensorData(message.name, message.datatype, tuple(message.shape), message.data)


def tensors_to_proto(tensors: list[TensorData]) -> list[tensor_pb2.Tensor]:
    return [tensor_to_proto(t) for t in tensors]


def tensors_from_proto(messages) -> list[TensorData]:
    return [tensor_from_proto(m) for m in messages]


def error_to_proto(error: InfermeshError) -> tensor_pb2.Error:
    return tensor_pb2.Error(code=error.code, message=error.message, retry_after_ms=getattr(error, "retry_after_ms", 0))
