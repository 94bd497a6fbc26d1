"""A reader of the protobuf wire format: enough to walk a message's fields and
count its repeated ones before anything parses it, at a cost bounded by how
many fields the walk may visit (its budget), never by the message's size.

A length-delimited field is skipped by its length, and a packed field's
elements are counted by C-level byte operations, so only fields that are
each their own record (a BYTES element, an unpacked number, a submessage)
cost a step of Python each.
"""

VARINT, I64, LEN, SGROUP, EGROUP, I32 = range(6)
MAX_FIELD_NUMBER = (1 << 29) - 1
_HIGH_BYTES = bytes(range(0x80, 0x100))  # a varint's continuation bytes: every other byte ends one
_U64 = (1 << 64) - 1


class WireError(ValueError):
    """The bytes are not a valid protobuf encoding; the message says where."""


class BudgetExceeded(Exception):
    """A walk visited more fields than its budget: the message holds more than
    any the reader's caller accepts."""


def varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` (as an unsigned 64-bit value) and the position after it."""
    if pos < end:
        byte = buf[pos]
        if byte < 0x80:
            return byte, pos + 1
    result = shift = 0
    start = pos
    while pos < end:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise WireError(f"varint at offset {start} is longer than 10 bytes")
    raise WireError(f"varint at offset {start} runs past the end of its message at offset {end}")


def signed64(value: int) -> int:
    """An int64 field's value from its varint."""
    return value - (1 << 64) if value >= 1 << 63 else value


def packed_varints(buf: bytes, start: int, stop: int) -> int:
    """How many varints a packed field's payload holds (each ends at a byte under 0x80)."""
    return len(buf[start:stop].translate(None, _HIGH_BYTES))


def decode_packed_varints(buf: bytes, start: int, stop: int) -> list[int]:
    """The values of a packed varint field (call it on payloads already bounded in length)."""
    values = []
    pos = start
    while pos < stop:
        value, pos = varint(buf, pos, stop)
        values.append(value)
    return values


class Reader:
    """Walks the fields of one serialised message, `budget` fields in all (a
    group's inner fields included); the walk raises BudgetExceeded past it."""

    __slots__ = ("budget", "buf")

    def __init__(self, buf: bytes, budget: int):
        self.buf = buf
        self.budget = budget

    def spend(self, fields: int) -> None:
        self.budget -= fields
        if self.budget < 0:
            raise BudgetExceeded

    def fields(self, pos: int, end: int):
        """(number, wire_type, a, b) for each field of buf[pos:end]: a VARINT's
        value and its end, a LEN's payload as (start, stop), an I32's or I64's
        start and stop, a group's span (skipped whole, its fields counted)."""
        while pos < end:
            number, wire_type, a, b, pos = self.field(pos, end)
            yield number, wire_type, a, b

    def field(self, pos: int, end: int) -> tuple[int, int, int, int, int]:
        """The field at `pos` as `fields` gives it, and the position after it."""
        self.budget -= 1
        if self.budget < 0:
            raise BudgetExceeded
        buf = self.buf
        tag_at = pos
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0 or number > MAX_FIELD_NUMBER:
            raise WireError(f"field number {number} at offset {tag_at} is not valid")
        if wire_type == LEN:
            length = buf[pos] if pos < end else 0x80
            if length < 0x80:
                pos += 1
            else:
                length, pos = varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise WireError(
                    f"field {number} at offset {tag_at} declares {length} bytes but only "
                    f"{end - pos} remain in its message"
                )
            return number, LEN, pos, stop, stop
        if wire_type == VARINT:
            value, after = varint(buf, pos, end)
            return number, VARINT, value, after, after
        if wire_type in (I32, I64):
            stop = pos + (4 if wire_type == I32 else 8)
            if stop > end:
                raise WireError(f"field {number} at offset {tag_at} runs past the end of its message")
            return number, wire_type, pos, stop, stop
        if wire_type == SGROUP:
            stop = self._skip_group(number, pos, end, tag_at)
            return number, SGROUP, pos, stop, stop
        raise WireError(
            f"field {number} at offset {tag_at} has wire type {wire_type}, which no message may start a field with"
        )

    def repeated_len(self, tag: int, pos: int, end: int, most: int) -> tuple[int, int]:
        """Skips the run of length-delimited fields with the one-byte `tag` that
        starts at `pos`, `most` of them at most: (how many, the position after).
        A repeated bytes field's elements each cost this loop's step only."""
        buf = self.buf
        count = 0
        while pos < end and count < most and buf[pos] == tag:
            length = buf[pos + 1] if pos + 1 < end else 0x80
            if length < 0x80:
                pos += 2
            else:
                length, pos = varint(buf, pos + 1, end)
            pos += length
            if pos > end:
                raise WireError(f"field {tag >> 3} runs past the end of its message at offset {end}")
            count += 1
        return count, pos

    def _skip_group(self, number: int, pos: int, end: int, tag_at: int) -> int:
        """The position after the end-group tag closing the group `number` opened before pos."""
        buf = self.buf
        open_groups = [number]
        while pos < end:
            self.spend(1)
            tag, pos = varint(buf, pos, end)
            inner, wire_type = tag >> 3, tag & 7
            if wire_type == EGROUP:
                if inner != open_groups.pop():
                    raise WireError(f"group {number} opened at offset {tag_at} is closed by a mismatched end tag")
                if not open_groups:
                    return pos
            elif wire_type == SGROUP:
                open_groups.append(inner)
            elif wire_type == VARINT:
                _, pos = varint(buf, pos, end)
            elif wire_type == LEN:
                length, pos = varint(buf, pos, end)
                pos += length
            elif wire_type in (I32, I64):
                pos += 4 if wire_type == I32 else 8
            else:
                raise WireError(f"group {number} opened at offset {tag_at} holds wire type {wire_type}")
        raise WireError(f"group {number} opened at offset {tag_at} is never closed")


def count_fields(buf: bytes, descriptor, budget: int) -> int:
    """How many fields `buf`, a serialised message of `descriptor`'s type, holds
    in all (submessages' fields and packed elements included); raises
    BudgetExceeded once past `budget`, WireError where it is not valid. What a
    parser's work grows with, counted at a cost bounded by the budget."""
    reader = Reader(buf, budget)
    _count(reader, descriptor, 0, len(buf), 0)
    return budget - reader.budget


MAX_DEPTH = 64


def _count(reader: Reader, descriptor, pos: int, end: int, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise WireError(f"messages nested more than {MAX_DEPTH} deep")
    by_number = descriptor.fields_by_number
    for number, wire_type, a, b in reader.fields(pos, end):
        field = by_number.get(number)
        if field is None or wire_type != LEN:
            continue
        if field.message_type is not None:
            _count(reader, field.message_type, a, b, depth + 1)
        elif field.type not in (field.TYPE_STRING, field.TYPE_BYTES):  # a packed repeated scalar
            width = {
                field.TYPE_FLOAT: 4,
                field.TYPE_FIXED32: 4,
                field.TYPE_SFIXED32: 4,
                field.TYPE_DOUBLE: 8,
                field.TYPE_FIXED64: 8,
                field.TYPE_SFIXED64: 8,
            }.get(field.type)
            reader.spend((b - a) // width if width else packed_varints(reader.buf, a, b))
