"""A gRPC request carrying a field this server's chunkserve.proto lacks (a client built from a
newer one) is refused with INVALID_ARGUMENT naming the field number and the message, nested
messages included, instead of being served with the field dropped unread."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.errors import InvalidRequestError
from scheduler_svc.validation import check_known_fields
from tests.scheduler_svc.test_http_api import assert_idle, running


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _with_field(message: bytes, number: int, value: int = 5) -> bytes:
    """`message` plus a varint field `number` (protobuf's wire format appends fields freely)."""
    return message + _varint(number << 3) + _varint(value)


def _nested(outer: bytes, number: int, inner: bytes) -> bytes:
    return outer + _varint(number << 3 | 2) + _varint(len(inner)) + inner


PLAIN = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))


def test_a_known_request_passes():
    check_known_fields(PLAIN)
    check_known_fields(pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")])))


@given(st.integers(min_value=200, max_value=10_000))
def test_an_unknown_top_level_field_is_named(number):
    request = pb.GenerateRequest.FromString(_with_field(PLAIN.SerializeToString(), number))
    with pytest.raises(
        InvalidRequestError, match=rf"request has field number {number} that chunkserve.v1.GenerateRequest"
    ):
        check_known_fields(request)


def test_an_unknown_field_inside_sampling_is_named_by_its_path():
    sampling = _with_field(pb.SamplingParams(max_tokens=2).SerializeToString(), 999)
    field = pb.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].number
    request = pb.GenerateRequest.FromString(_nested(pb.GenerateRequest(text="hi").SerializeToString(), field, sampling))
    with pytest.raises(InvalidRequestError, match=r"sampling has field number 999 that chunkserve.v1.SamplingParams"):
        check_known_fields(request)


def test_the_grpc_front_refuses_it_and_holds_nothing(fakes, byte_tokenizer_dir, monkeypatch):
    raw = _with_field(PLAIN.SerializeToString(), 4242)

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, _base):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
                call = channel.unary_stream(
                    "/chunkserve.v1.Generation/Generate",
                    request_serializer=lambda b: b,
                    response_deserializer=pb.GenerateResponse.FromString,
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in call(raw)]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "field number 4242" in err.value.details()
                ok = [m async for m in call(PLAIN.SerializeToString())]
                assert ok and ok[-1].finish_reason
            assert_idle(app)

    asyncio.run(main())
