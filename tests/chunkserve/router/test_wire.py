"""The router's request-id splice (chunkserve/router/wire.py): the bytes it relays parse as the
replica's message with the router's id, whatever the message holds (hypothesis)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from chunkserve.router.wire import request_id_field, with_request_id
from chunkserve_contracts.v1 import chunkserve_pb2 as pb

texts = st.text(max_size=300)  # ids past 127 bytes need a two-byte length


@st.composite
def responses(draw) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=draw(texts),
        token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)),
        text=draw(texts),
        finished=draw(st.booleans()),
        client_request_id=draw(st.text(max_size=20)),
        prompt_tokens=draw(st.integers(0, 2**32 - 1)),
    )
    for _ in range(draw(st.integers(0, 2))):
        msg.logprobs.add(logprob=draw(st.floats(-50, 0)), top=[pb.TokenLogprob(token_id=3, logprob=-1.0, text="a")])
    if msg.finished:
        msg.finish_reason = draw(st.sampled_from([0, 1, 2]))
        msg.usage.prompt_tokens, msg.usage.cached_tokens = draw(st.integers(0, 9999)), draw(st.integers(0, 9999))
        if draw(st.booleans()):
            msg.matched_stop_token_id = draw(st.integers(0, 2**32 - 1))
    return msg


@given(responses(), texts)
def test_the_spliced_bytes_are_the_message_with_the_routers_id(msg, rid):
    relayed = with_request_id(msg.SerializeToString(), request_id_field(rid))
    expected = pb.GenerateResponse()
    expected.CopyFrom(msg)
    expected.request_id = rid
    assert pb.GenerateResponse.FromString(relayed) == expected
    no_id = pb.GenerateResponse()
    no_id.CopyFrom(msg)
    no_id.ClearField("request_id")
    # the replica's own id is cut, not only hidden by the later value: one request_id on the wire
    assert len(relayed) == len(no_id.SerializeToString()) + len(request_id_field(rid))


@given(responses(), texts)
def test_a_request_id_anywhere_in_the_message_is_overridden(msg, rid):
    """A serializer that wrote fields in another order: the appended id still wins."""
    data = msg.SerializeToString()
    moved = pb.GenerateResponse()
    moved.CopyFrom(msg)
    moved.ClearField("request_id")
    reordered = moved.SerializeToString() + request_id_field(msg.request_id)  # request_id last
    out = pb.GenerateResponse.FromString(with_request_id(reordered, request_id_field(rid)))
    assert out.request_id == rid and out.token_ids == msg.token_ids and len(data) <= len(reordered) + 1
