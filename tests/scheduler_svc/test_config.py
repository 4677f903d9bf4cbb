"""The rules pairing scheduler settings with the executor's handshake have one home
(config.validate_against_executor): a setting is refused alike when the server starts with it
and when an operator sets it live, with the same message, and a refused live change moves
nothing. The start-up side runs SchedulerApp.start() against a fake executor client, the live
side the Admin service over real gRPC."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from chunkserve.launch import free_port
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc import app as app_module
from scheduler_svc.config import SchedulerConfig, resolve_auto, validate_against_executor


async def start(fakes, config: SchedulerConfig, hs: epb.HandshakeResponse, monkeypatch) -> app_module.SchedulerApp:
    """A started SchedulerApp whose executor client answers `hs` (fakes.fake_handshake's defaults: an
    executor accepting 2048 tokens a step, with 64 blocks x 16 tokens (1024) and no swap space)."""
    monkeypatch.setattr(app_module, "ExecutorClient", lambda *args, **kwargs: fakes.FakeExecutorClient(hs))
    app = app_module.SchedulerApp(
        dataclasses.replace(
            config, host="127.0.0.1", port=0, metrics_port=0, http_port=0, admin_port=free_port(), startup_timeout_s=10
        )
    )
    try:
        await app.start()
    except BaseException:
        await app.stop(grace=0)
        raise
    return app


# Each rule a live change can break: (settings the server starts with, the change, words of the refusal).
LIVE_RULES = {
    "budget over the executor's": (
        dict(max_num_batched_tokens=512, max_model_len=1024),
        dict(max_num_batched_tokens=4096),
        "larger than the executor's 2048",
    ),
    "chunking off, budget under max_model_len": (
        dict(max_num_batched_tokens=512, max_model_len=1024),
        dict(enable_chunked_prefill=False),
        "with chunked prefill off",
    ),
    "budget under max_model_len, chunking off": (
        dict(max_num_batched_tokens=512, max_model_len=512, enable_chunked_prefill=False),
        dict(max_num_batched_tokens=256),
        "with chunked prefill off",
    ),
}


@pytest.mark.parametrize("case", LIVE_RULES)
def test_a_rule_refuses_alike_at_start_up_and_live(fakes, byte_tokenizer_dir, monkeypatch, case):
    settings, change, words = LIVE_RULES[case]
    good = SchedulerConfig(**settings)
    hs = fakes.fake_handshake(byte_tokenizer_dir)

    async def main():
        with pytest.raises(ValueError) as at_start:
            await start(fakes, dataclasses.replace(good, **change), hs, monkeypatch)
        app = await start(fakes, good, hs, monkeypatch)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.config.admin_port}") as channel:
                admin = pb_grpc.AdminStub(channel)
                before = await admin.GetConfig(pb.GetConfigRequest())
                with pytest.raises(grpc.aio.AioRpcError) as live:
                    await admin.UpdateConfig(pb.SchedulingConfig(**change))
                assert await admin.GetConfig(pb.GetConfigRequest()) == before  # nothing moved
                assert app.ready.engine.scheduler.snapshot().config == resolve_auto(app.config, hs)  # as started
        finally:
            await app.stop(grace=0)
        assert words in str(at_start.value)
        assert live.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert live.value.details() == str(at_start.value)

    asyncio.run(main())


@pytest.mark.parametrize(
    "settings, hs, words",
    [
        (dict(preemption_mode="swap"), {}, "--swap-space > 0"),
        (dict(max_model_len=2000), {}, "the KV pool (64 blocks x 16 tokens) = 1024"),
        (dict(max_model_len=1024), dict(max_position_embeddings=512), "max_position_embeddings) = 512"),
        (
            dict(max_model_len=1024, max_num_batched_tokens=512, enable_chunked_prefill=False),
            {},
            "with chunked prefill off (a prompt must fit one step) = 512",
        ),
    ],
    ids=["swap without host blocks", "over the pool", "over the context", "over the budget, chunking off"],
)
def test_start_up_only_rules(fakes, settings, hs, words):
    """Rules on settings no live change touches (preemption mode, max_model_len)."""
    with pytest.raises(ValueError) as err:
        validate_against_executor(SchedulerConfig(**settings), fakes.fake_handshake(**hs))
    assert words in str(err.value)
    assert (
        validate_against_executor(
            SchedulerConfig(**settings),
            fakes.fake_handshake(num_host_blocks=8, num_device_blocks=256, max_position_embeddings=4096),
            max_model_len=512,
        )
        == 512
    )  # fits once the executor has room


def test_max_model_len_is_the_largest_that_works(fakes):
    handshake = fakes.fake_handshake
    assert validate_against_executor(SchedulerConfig(), handshake()) == 1024  # the pool
    assert validate_against_executor(SchedulerConfig(), handshake(max_position_embeddings=512)) == 512
    assert (
        validate_against_executor(
            SchedulerConfig(max_num_batched_tokens=256, enable_chunked_prefill=False), handshake()
        )
        == 256
    )
    assert validate_against_executor(SchedulerConfig(max_model_len=300), handshake()) == 300


def test_an_executor_back_with_settings_that_do_not_fit_is_waited_out(fakes, byte_tokenizer_dir, monkeypatch, caplog):
    """The executor restarts with a smaller step budget than the live settings: the scheduler
    says why once, stays NOT_SERVING without giving up, and serves again when an executor
    that fits answers (it used to end its supervisor task and never serve again)."""
    from grpc_health.v1 import health_pb2

    good = fakes.fake_handshake(byte_tokenizer_dir)
    small = fakes.fake_handshake(byte_tokenizer_dir, max_num_batched_tokens=256)

    async def until(predicate) -> None:
        for _ in range(600):  # a failsafe, not a timing assumption: the state is polled
            if await predicate():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("state not reached")

    async def main():
        app = await start(fakes, SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024), good, monkeypatch)

        async def serving() -> bool:
            request = health_pb2.HealthCheckRequest(service=app_module.SERVICE_NAME)
            return (await app.health.Check(request, None)).status == health_pb2.HealthCheckResponse.SERVING

        async def refused() -> bool:
            return "larger than the executor's 256" in caplog.text

        try:
            client, first = app.ready.client, app.ready
            client.hs = small
            first.engine.fail("executor unavailable: restarted")
            await until(refused)
            assert not await serving()
            assert not app._supervisor.done() and app.ready is first
            assert first.info.tensor_parallel_size == 1  # a handshake without the field: one device
            client.hs = fakes.fake_handshake(byte_tokenizer_dir, tensor_parallel_size=2)  # back as a group of 2
            await until(serving)
            assert app.ready is not first and app.ready.info.tensor_parallel_size == 2
            assert caplog.text.count("do not fit") == 1
        finally:
            await app.stop(grace=0)

    asyncio.run(main())
