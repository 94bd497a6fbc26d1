"""The check of a serialised ModelInferRequest before it is parsed.

Parsing holds the GIL for as long as it takes, and what it takes grows with
the number of fields, not bytes: 7 million empty BYTES elements in 14 MB
take upb 220 ms, and the event loop, with every health check behind it,
waits that long. This walk visits the fields of the request, of each input,
output and parameter, counting the repeated ones against what the shapes
and the limits allow, and refuses as soon as a count goes past them. It
stops within RequestLimits.field_budget fields plus max_typed_elements
elements, whatever the message holds.
"""

from services.common import errors
from services.common.wire import (
    I32,
    I64,
    LEN,
    VARINT,
    BudgetExceeded,
    Reader,
    WireError,
    decode_packed_varints,
    packed_varints,
    signed64,
)
from services.router import limits as rules
from services.router.limits import CONTENTS_FIELDS, MAX_DIMS, RequestLimits

PACKED_WIDTH = {6: 4, 7: 8}  # fp32 and fp64 contents; the others are varints
UNPACKED_WIRE_TYPE = {1: VARINT, 2: VARINT, 3: VARINT, 4: VARINT, 5: VARINT, 6: I32, 7: I64}
HEADER_FIELDS = 64  # a header's fields come first as protobuf writes them: this many are plenty


def check_request(raw: bytes, limits: RequestLimits) -> None:
    """Raises InvalidArgument, naming the field, where the request's repeated
    fields hold more than its shapes and `limits` allow, or WireError where
    it is not a valid message. Accepts every request that passes
    oip.check_counts once parsed (the same rules, counted on the wire), but
    for what the parser folds away at a cost: fields given twice (the field
    budget) and map entries that repeat a key (counted as entries)."""
    reader = Reader(raw, limits.field_budget)
    try:
        _walk(reader, limits)
    except BudgetExceeded:
        raise rules.too_many_fields(limits.field_budget) from None


def header(raw: bytes) -> tuple[str, str, str]:
    """The request's model_name, model_version and id as far as its first
    fields hold them (empty where not), at a cost independent of its size."""
    found = {1: "", 2: "", 3: ""}
    reader = Reader(raw, HEADER_FIELDS)
    try:
        for number, wire_type, start, stop in reader.fields(0, len(raw)):
            if number in found and wire_type == LEN:
                found[number] = _text(raw, start, stop)
            elif number > 3 and all(found.values()):
                break
    except (BudgetExceeded, WireError):
        pass
    return found[1], found[2], found[3]


def _walk(reader: Reader, limits: RequestLimits) -> None:
    raw = reader.buf
    inputs = outputs = contents = parameters = 0
    typed = [0]  # elements of typed contents so far, all inputs together
    for number, wire_type, start, stop in reader.fields(0, len(raw)):
        if wire_type != LEN:
            continue  # a string given as something else: the parser keeps it as an unknown field
        if number == 5:
            inputs += 1
            if inputs > limits.max_inputs:
                raise rules.too_many("inputs", limits.max_inputs, "max_inputs")
            _walk_input(reader, start, stop, limits, typed)
        elif number == 7:
            contents += 1
            if contents > limits.max_inputs:
                raise rules.too_many("raw_input_contents entries", limits.max_inputs, "max_inputs")
        elif number == 6:
            outputs += 1
            if outputs > limits.max_outputs:
                raise rules.too_many("requested outputs", limits.max_outputs, "max_outputs")
            _walk_output(reader, start, stop, limits)
        elif number == 4:
            parameters += 1
            if parameters > limits.max_parameters:
                raise rules.too_many("parameters", limits.max_parameters, "max_parameters")
            _walk_entry(reader, start, stop)


def _walk_input(reader: Reader, start: int, stop: int, limits: RequestLimits, typed: list[int]) -> None:
    """Shape and parameters first (the contents may come before them on the
    wire), then the contents against the element count the shape gives."""
    raw = reader.buf
    name = (start, start)
    dims: list[int] = []
    parameters = 0
    spans = []
    for number, wire_type, a, b in reader.fields(start, stop):
        if number == 3:
            if wire_type == LEN:
                if b - a > 10 * MAX_DIMS or len(dims) + packed_varints(raw, a, b) > MAX_DIMS:
                    raise rules.too_many_dims(_text(raw, *name))
                dims.extend(decode_packed_varints(raw, a, b))
            elif wire_type == VARINT:
                dims.append(a)
            if len(dims) > MAX_DIMS:
                raise rules.too_many_dims(_text(raw, *name))
        elif wire_type != LEN:
            continue
        elif number == 1:
            name = (a, b)
        elif number == 5:
            spans.append((a, b))
        elif number == 4:
            parameters += 1
            if parameters > limits.max_parameters:
                raise rules.too_many_parameters(f"input {_shown(raw, *name)}", limits.max_parameters)
            _walk_entry(reader, a, b)
    shape = [signed64(d) for d in dims]
    if any(d < 0 for d in shape):
        raise rules.negative_dimension(_text(raw, *name), shape)
    if spans:
        _walk_contents(reader, spans, _text(raw, *name), shape, rules.element_count(shape), limits, typed)


BYTES_TAG = 8 << 3 | LEN  # bytes_contents, the field whose elements are most numerous for their bytes


def _walk_contents(
    reader: Reader, spans, name: str, shape: list[int], allowed: int, limits: RequestLimits, typed: list[int]
) -> None:
    raw = reader.buf
    counts = dict.fromkeys(CONTENTS_FIELDS, 0)
    for pos, stop in spans:  # a field given twice is one, concatenated, as the parser merges it
        while pos < stop:
            if raw[pos] == BYTES_TAG:
                # A run of BYTES elements: at most one past either bound is looked at.
                most = min(allowed - counts[8], limits.max_typed_elements - typed[0]) + 1
                found, pos = reader.repeated_len(BYTES_TAG, pos, stop, most)
                number = 8
            else:
                number, wire_type, a, b, pos = reader.field(pos, stop)
                if number not in counts:
                    continue
                if wire_type == LEN:
                    if number == 8:
                        found = 1
                    elif number in PACKED_WIDTH:
                        width = PACKED_WIDTH[number]
                        if (b - a) % width:
                            raise WireError(
                                f"packed {CONTENTS_FIELDS[number]} of input {name!r} holds {b - a} "
                                f"bytes, not a multiple of {width}"
                            )
                        found = (b - a) // width
                    else:
                        found = packed_varints(raw, a, b)
                elif wire_type == UNPACKED_WIRE_TYPE.get(number):
                    found = 1
                else:
                    continue  # kept as an unknown field by the parser; the budget counted it
                if found:
                    reader.budget += 1  # elements are bounded by max_typed_elements instead
            counts[number] += found
            if counts[number] > allowed:
                raise rules.too_many_elements(name, CONTENTS_FIELDS[number], shape, allowed)
            typed[0] += found
            if typed[0] > limits.max_typed_elements:
                raise rules.too_many_typed(limits.max_typed_elements)


def _walk_output(reader: Reader, start: int, stop: int, limits: RequestLimits) -> None:
    raw = reader.buf
    name = (start, start)
    parameters = 0
    for number, wire_type, a, b in reader.fields(start, stop):
        if wire_type != LEN:
            continue
        if number == 1:
            name = (a, b)
        elif number == 2:
            parameters += 1
            if parameters > limits.max_parameters:
                raise rules.too_many_parameters(f"requested output {_shown(raw, *name)}", limits.max_parameters)
            _walk_entry(reader, a, b)


def _walk_entry(reader: Reader, start: int, stop: int) -> None:
    """A parameter map's entry and its InferParameter: scalars only, but the
    parser visits every field they hold, so the walk counts them too."""
    for number, wire_type, a, b in reader.fields(start, stop):
        if number == 2 and wire_type == LEN:
            for _ in reader.fields(a, b):
                pass


def _text(raw: bytes, start: int, stop: int) -> str:
    return raw[start:stop].decode("utf-8", "replace")


def _shown(raw: bytes, start: int, stop: int) -> str:
    return errors.shown(_text(raw, start, stop))
