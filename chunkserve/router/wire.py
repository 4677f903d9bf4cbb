"""GenerateResponse bytes with the request id replaced, without decoding the message.

The router relays every streamed message; decoding and encoding each one again only to
change `request_id` (field 1, a string) cost more than the relay's own bookkeeping. Protobuf
serializers write fields in field-number order, so a replica's message starts with its
request_id when it has one: that field is cut, and the router's id is appended. A string
field that occurs twice takes its last value (the protobuf encoding rule), so the result
parses as the message with the router's id whatever order the fields came in.
"""

from __future__ import annotations

REQUEST_ID_TAG = 0x0A  # field 1, wire type 2 (length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def request_id_field(request_id: str) -> bytes:
    """The encoding of `request_id = <request_id>` (field 1), to append to a message."""
    raw = request_id.encode()
    return bytes([REQUEST_ID_TAG]) + _varint(len(raw)) + raw


def with_request_id(data: bytes, field: bytes) -> bytes:
    """`data` (a serialized GenerateResponse) with its request_id replaced by `field`
    (request_id_field's bytes): the leading request_id cut when there is one, `field` appended."""
    if data[:1] != b"\x0a":
        return data + field
    length = shift = 0
    pos = 1
    while pos < len(data):
        byte = data[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        if byte < 0x80:
            return data[pos + length :] + field
        shift += 7
    return data + field  # a truncated varint: not a message; relayed as it came (the client says so)
