"""The scheduler's side of chunkserve.executor.v1: plan objects in, result objects out."""

from __future__ import annotations

import grpc

from chunkserve_contracts import __version__
from chunkserve_contracts.auth import bearer_metadata
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc
from scheduler_svc.errors import StepFailedError
from scheduler_svc.plan import PromptLogprob, Sampled, StepPlan, StepResult
from scheduler_svc.request import SamplingParams

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # The handshake waits for an executor that is still loading (wait_for_ready): gRPC's
    # default reconnect backoff grows 1.6x per attempt to 120 s, so an executor ready after
    # 30 s was found up to ~13 s late (attempts at 26 s, then 43 s). Loopback or LAN
    # connection attempts are cheap; one a second at most finds it within a second.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def sampling_to_proto(params: SamplingParams) -> epb.SamplingParams:
    return epb.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        has_seed=params.seed is not None,
        seed=params.seed or 0,
        num_logprobs=-1 if params.logprobs is None else params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias),
        num_prompt_logprobs=0 if params.prompt_logprobs is None else params.prompt_logprobs + 1,
        allowed_token_ids=params.allowed_token_ids,
        bad_words=[epb.BadWord(token_ids=ids) for ids in params.bad_words],
    )


def plan_to_proto(plan: StepPlan) -> epb.StepRequest:
    return epb.StepRequest(
        step_id=plan.step_id,
        new_seqs=[
            epb.NewSequence(
                seq_id=n.seq_id,
                sampling=sampling_to_proto(n.sampling),
                prompt_token_ids=n.prompt_token_ids,
                output_token_ids=n.output_token_ids,
            )
            for n in plan.new_seqs
        ],
        seqs=[
            epb.ScheduledSequence(
                seq_id=s.seq_id,
                num_computed_tokens=s.num_computed_tokens,
                num_new_tokens=s.num_new_tokens,
                token_ids=s.token_ids,
                block_ids=s.new_block_ids,
                replace_block_table=s.replace_block_table,
                sample=s.sample,
                token_masks=[epb.TokenMask(position=m.position, bits=m.bits) for m in s.token_masks],
                draft_token_ids=s.draft_token_ids,
                prompt_logprob_first=s.prompt_logprob_first,
                prompt_logprob_rows=s.prompt_logprob_rows,
                next_token_id=s.next_token_id,
            )
            for s in plan.seqs
        ],
        finished_seq_ids=plan.finished_seq_ids,
        swap_out=[epb.BlockCopy(src=d, dst=h) for d, h in plan.swap_out],
        swap_in=[epb.BlockCopy(src=h, dst=d) for h, d in plan.swap_in],
        follows_step_id=plan.follows_step_id,
    )


def result_from_proto(msg: epb.StepResponse) -> StepResult:
    return StepResult(
        step_id=msg.step_id,
        sampled=[
            Sampled(s.seq_id, s.token_id, s.logprob, [(t.token_id, t.logprob) for t in s.top]) for s in msg.sampled
        ],
        prompt_logprobs=[
            PromptLogprob(p.seq_id, p.position, p.token_id, p.logprob, [(t.token_id, t.logprob) for t in p.top], p.rank)
            for p in msg.prompt_logprobs
        ],
        execute_ns=msg.execute_ns,
        forward_ns=msg.forward_ns,
        sample_ns=msg.sample_ns,
        swap_ns=msg.swap_ns,
        start_unix_ns=msg.start_unix_ns,
        num_threads=msg.num_threads,
    )


class ExecutorClient:
    """An async client for the executor; create it inside the running event loop. With a
    token, every call carries `authorization: Bearer <token>` (the executor's check)."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = epb_grpc.ExecutorStub(self._channel)
        self._metadata = bearer_metadata(token)

    async def handshake(self, timeout: float) -> epb.HandshakeResponse:
        """Waits (up to timeout) for the executor to come up, then asks its capabilities."""
        return await self._stub.Handshake(
            epb.HandshakeRequest(scheduler_version=__version__),
            timeout=timeout,
            wait_for_ready=True,
            metadata=self._metadata,
        )

    async def step(self, plan: StepPlan, timeout: float) -> StepResult:
        """Runs one step. A step the executor refused while staying alive (out of memory, a
        rejected plan) raises StepFailedError; anything else means the executor is gone."""
        try:
            return result_from_proto(
                await self._stub.Step(plan_to_proto(plan), timeout=timeout, metadata=self._metadata)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT):
                raise StepFailedError(f"step {plan.step_id} failed: {exc.details()}", exc.code()) from None
            raise

    async def reset(self, timeout: float = 10.0) -> None:
        await self._stub.Reset(epb.ResetRequest(), timeout=timeout, metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()
