"""What one request may hold, and the refusals of the rules that count it.

The rules are checked twice in two forms that must agree: on the wire before
a large message is parsed (services/router/precheck.py), and on the parsed
message (services/router/oip.py check_counts) for every message; both refuse
with the functions below, so that they say the same.
"""

import dataclasses
import math
from collections.abc import Iterable

from services.common import errors

# Dimensions of one input's shape: numpy's own bound is 64, and no model served
# here has more than a handful.
MAX_DIMS = 32
# Fields a message may hold beyond what its counted parts account for (fields
# given twice, unknown ones from a newer client); the protobuf library writes none.
SLACK_FIELDS = 1024

# The typed contents fields of InferTensorContents, by field number.
CONTENTS_FIELDS = {
    1: "bool_contents",
    2: "int_contents",
    3: "int64_contents",
    4: "uint_contents",
    5: "uint64_contents",
    6: "fp32_contents",
    7: "fp64_contents",
    8: "bytes_contents",
}


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Bounds on one ModelInferRequest, checked before any per-element work."""

    max_inputs: int = 64
    max_outputs: int = 64
    max_parameters: int = 32  # entries of each parameter map: the request's, an input's, an output's
    max_typed_elements: int = 1 << 16  # in typed `contents`, all inputs together
    max_text_bytes: int = 64 * 1024  # of one BYTES element

    def __post_init__(self) -> None:
        for name in ("max_inputs", "max_outputs", "max_parameters", "max_typed_elements", "max_text_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def field_budget(self) -> int:
        """Fields (besides typed contents elements) that the largest request within
        the limits holds, written as protobuf writes it or unpacked, plus slack: a
        walk of the wire that stops there costs no more than such a request."""
        entry = 4  # a map entry: its own field, key, value, the value's one field
        tensor = 1 + 2 + MAX_DIMS + self.max_parameters * entry + 1  # field, name and datatype, dims, contents
        output = 1 + 1 + self.max_parameters * entry
        top = 3 + self.max_parameters * entry + self.max_inputs * (tensor + 1) + self.max_outputs * output
        return top + SLACK_FIELDS


def shape_text(shape: Iterable[int]) -> str:
    return str([int(d) for d in shape])


def element_count(shape: Iterable[int]) -> int:
    return math.prod(shape)


def too_many(what: str, limit: int, option: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"request carries more than {limit} {what}; the router takes at most {limit} (--{option.replace('_', '-')})"
    )


def too_many_parameters(where: str, limit: int) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"{where} carries more than {limit} parameters; the router takes at most {limit} per map (--max-parameters)"
    )


def too_many_dims(name: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"input {errors.shown(name)} has a shape of more than {MAX_DIMS} dimensions")


def negative_dimension(name: str, shape: Iterable[int]) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"input {errors.shown(name)} has shape {shape_text(shape)} with a negative dimension")


def too_many_elements(name: str, field: str, shape: Iterable[int], allowed: int) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"input {errors.shown(name)} carries more than {allowed} {field} elements; its "
        f"shape {shape_text(shape)} holds {allowed}"
    )


def too_many_typed(limit: int) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"request carries more than {limit} typed contents elements in all; send larger "
        "tensors as raw_input_contents (--max-typed-elements)"
    )


def too_many_fields(budget: int) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"request holds more than {budget} protobuf fields besides its contents, more than "
        "any request within the router's limits has"
    )
