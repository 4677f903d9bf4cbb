"""End to end on the real default model (SmolLM2-135M-Instruct), over gRPC, two processes.

The reference is Hugging Face transformers' own `generate` on the same saved weights and
dtype (float32), so "equal" means our model, kernels, paged KV cache, chunking, batching,
scheduler and detokenizer all agree with it token for token.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import grpc
import pytest

from chunkserve.client import Completion, build_request
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from tests.hf_reference import PENALTIES
from tests.hf_reference import hf_greedy as hf_penalized

pytestmark = pytest.mark.slow

BUDGET = 128  # max_num_batched_tokens: the 200-token prompt is prefilled in two chunks
BLOCK = 16
LENGTHS = [5, 15, 16, 17, 32, 33, 64, 200]  # around block multiples, and one > BUDGET
NEW_TOKENS = 32
TEXT = (
    "The history of computing is longer than the history of computing hardware and modern "
    "computing technology and includes the history of methods intended for pen and paper or for "
    "chalk and slate, with or without the aid of tables. Digital computing is intimately tied to "
    "the representation of numbers. But long before abstractions like the number arose, there "
    "were mathematical concepts to serve the purposes of civilization. These concepts are implicit "
    "in concrete practices such as one-to-one correspondence, the basis of counting, comparison "
    "to a standard, used for measurement, and the 3-4-5 right triangle, a device for assuring a "
    "right angle. The earliest known tool for use in computation was the abacus, and it was "
    "thought to have been invented in Babylon circa 2400 BC. Its original style of usage was by "
    "lines drawn in sand with pebbles. Abaci, of a more modern design, are still used as "
    "calculation tools today. This was the first known calculation aid, preceding Greek methods "
    "by 2,000 years. The first recorded idea of using digital electronics for computing was the "
    "1931 paper The Use of Thyratrons for High Speed Automatic Counting of Physical Phenomena."
)


@pytest.fixture(scope="module")
def hf(default_model_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def prompts(hf) -> list[list[int]]:
    ids = hf[1](TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= max(LENGTHS)
    return [ids[:n] for n in LENGTHS]


@pytest.fixture(scope="module")
def server(default_model_path, launch):
    return launch(
        [
            "--model",
            str(default_model_path),
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--kv-cache-memory-gib",
            "0.25",
        ],
        # BUDGET is the scheduler's; the executor keeps its default limit, so its CPU linear
        # plan (keyed by the buckets up to that limit) is the one this run's other default-model
        # servers measured or read, not a second measurement (~20-40 s on 2 cores)
        ["--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "32"],
    )


@pytest.fixture(autouse=True)
def no_leaks(request):
    """After every test that used the server: all blocks free, no request left."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").assert_idle_and_no_leaks()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' generate, greedy, exactly n new tokens (no stop on EOS)."""
    import copy

    import torch

    model = hf[0]
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.do_sample = False
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), generation_config=config, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def greedy(prompt, **kw) -> pb.GenerateRequest:
    return build_request(prompt, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


def run(stub, request, timeout=300) -> Completion:
    out = Completion()
    for msg in stub.Generate(request, timeout=timeout):
        out.add(msg)
    return out


@pytest.fixture(scope="module")
def expected(hf, prompts) -> list[list[int]]:
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def penalized(hf, prompts, expected, default_model_path) -> tuple[pb.GenerateRequest, list[int]]:
    """A request the suites below add to their load, so its chunks, preemptions and prefix hits
    are checked too, with its expected tokens: the longest prompt with all three penalties
    (tests/hf_reference.py) and a bad word, one its penalized output holds (as the scheduler
    tokenizes it: validation.bad_words_token_ids)."""
    from scheduler_svc.tokenizer import Tokenizer
    from scheduler_svc.validation import bad_words_token_ids

    out = hf_penalized(hf[0], prompts[-1], NEW_TOKENS, **PENALTIES)
    assert out != expected[-1], "the penalties change nothing on this prompt: a weak check"
    word = next(w for w in (hf[1].decode([t]) for t in out[2:]) if len(w.strip()) > 1)
    ids = bad_words_token_ids([word], Tokenizer(default_model_path), hf[0].config.vocab_size)
    want = hf_penalized(hf[0], prompts[-1], NEW_TOKENS, bad_words=ids, **PENALTIES)
    assert want != out, "the bad word changes nothing: a weak check"
    return greedy(prompts[-1], bad_words=[word], **PENALTIES), want


def test_greedy_tokens_equal_transformers(server, prompts, expected):
    stub = server.stub()
    got = [run(stub, greedy(p)).token_ids for p in prompts]
    for n, g, e in zip(LENGTHS, got, expected):
        assert g == e, f"prompt of {n} tokens diverges at {next(i for i, (a, b) in enumerate(zip(g, e)) if a != b)}"


def test_concurrent_requests_give_the_same_tokens(server, prompts, expected):
    stub = server.stub()
    with concurrent.futures.ThreadPoolExecutor(len(prompts) * 2) as pool:
        # Each prompt twice, all at once: batches mix prefill chunks and decodes.
        results = list(pool.map(lambda p: run(stub, greedy(p)).token_ids, prompts + prompts))
    assert results == expected + expected


def test_text_prompt_and_usage(server, hf):
    done = run(server.stub(), greedy(TEXT[:300]))
    ids = hf[1](TEXT[:300])["input_ids"]
    assert done.usage.prompt_tokens == len(ids)
    assert done.token_ids == hf_greedy(hf, ids, NEW_TOKENS)
    assert done.usage.completion_tokens == NEW_TOKENS
    assert done.finish_reason == pb.FINISH_REASON_LENGTH


def test_streamed_chinese_text_is_never_split(server, hf):
    request = build_request(
        [{"role": "user", "content": "用中文写一首关于春天的短诗。"}], temperature=0.0, max_tokens=48, ignore_eos=True
    )
    done = run(server.stub(), request)
    assert done.num_messages > 10
    assert any(ord(c) > 0x2E80 for c in done.text), f"no CJK in the output: {done.text!r}"
    # Byte-level BPE splits CJK characters across tokens: some deltas must have been held back.
    assert done.num_messages - 1 > sum(1 for d in done.deltas if d)
    for delta in done.deltas[:-1]:  # the last may end in U+FFFD if max_tokens cut a character
        assert "\ufffd" not in delta
    assert "".join(done.deltas) == done.text == hf[1].decode(done.token_ids, skip_special_tokens=True)


def test_chat_prompt_matches_transformers_template(server, hf):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    done = run(server.stub(), build_request(messages, temperature=0.0, max_tokens=64))
    ids = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert done.usage.prompt_tokens == len(ids)
    assert done.finish_reason == pb.FINISH_REASON_STOP  # the model ends its answer with EOS
    assert "Paris" in done.text


def test_stop_string_and_stop_token(server, prompts, expected, hf):
    tok = hf[1]
    text = tok.decode(expected[6])
    stop = text[10:14]
    done = run(server.stub(), build_request(prompts[6], temperature=0.0, max_tokens=NEW_TOKENS, stop=[stop]))
    assert done.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and done.matched_stop == stop
    assert done.text == text[: text.index(stop)]
    stop_id = expected[6][5]
    request = build_request(prompts[6], temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[stop_id])
    done = run(server.stub(), request)
    assert done.token_ids == expected[6][: expected[6].index(stop_id) + 1]
    assert done.finish_reason == pb.FINISH_REASON_STOP


def test_seeded_sampling_is_reproducible_and_logprobs(server, prompts):
    stub = server.stub()
    req = build_request(prompts[3], temperature=0.8, top_p=0.9, seed=1234, max_tokens=16, logprobs=3, ignore_eos=True)
    a, b = run(stub, req), run(stub, req)
    assert a.token_ids == b.token_ids and len(a.logprobs) == 16
    for lp in a.logprobs:
        assert len(lp.top) == 3 and lp.logprob <= 0
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


@pytest.mark.parametrize(
    "request_fn, field",
    [
        (lambda: pb.GenerateRequest(text=""), "prompt"),
        (lambda: build_request([1, 2, 10**6]), "token_ids"),
        (lambda: build_request("hi", temperature=-1.0), "temperature"),
        (lambda: build_request("hi", top_p=0.0), "top_p"),
        (lambda: build_request("hi", max_tokens=10**6), "max_tokens"),
        (lambda: build_request("hi", logprobs=100), "logprobs"),
    ],
)
def test_bad_input_is_invalid_argument(server, request_fn, field):
    with pytest.raises(grpc.RpcError) as err:
        run(server.stub(), request_fn())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_cancelled_stream_frees_its_blocks(server, prompts):
    stub = server.stub()
    call = stub.Generate(build_request(prompts[7], temperature=0.0, max_tokens=500, ignore_eos=True))
    next(m for m in call if m.token_ids)  # the first token: the request holds blocks now
    assert server.info().num_free_device_blocks < server.info().num_device_blocks
    call.cancel()
    # no_leaks checks the pool after the test


def test_abort_by_id(server, prompts):
    stub = server.stub()
    call = stub.Generate(build_request(prompts[7], temperature=0.0, max_tokens=500, ignore_eos=True))
    first = next(call)
    assert stub.Abort(pb.AbortRequest(request_id=first.request_id)).found
    rest = list(call)
    assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORTED
    assert not stub.Abort(pb.AbortRequest(request_id=first.request_id)).found


def test_running_scheduler_has_no_torch_loaded(server):
    maps = open(f"/proc/{server.scheduler.pid}/maps").read()
    assert "libtorch" not in maps
    assert "libtorch" in open(f"/proc/{server.executor.pid}/maps").read()


def test_chunkserve_serve_and_generate_cli(default_model_path, tmp_path):
    """The README's path: `chunkserve serve` (executor as a child) and `chunkserve generate`."""
    import os
    import signal
    import socket

    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = dict(
        os.environ,
        CHUNKSERVE_PORT=str(ports[0]),
        CHUNKSERVE_EXECUTOR_PORT=str(ports[1]),
        CHUNKSERVE_METRICS_PORT=str(ports[2]),
        CHUNKSERVE_ADMIN_PORT="0",
        CHUNKSERVE_HTTP_PORT="0",
        CHUNKSERVE_KV_CACHE_MEMORY_GIB="0.1",
    )
    cli = [sys.executable, "-m", "chunkserve.cli"]
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
        cli + ["serve", "--model", str(default_model_path), "--host", "127.0.0.1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 300
        while "serving on" not in (tmp_path / "serve.log").read_text():
            assert serve.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        out = subprocess.run(
            cli + ["generate", "--chat", "--temperature", "0", "--max-tokens", "40", "What is the capital of France?"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout
        assert "[stop; prompt" in out.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0, (tmp_path / "serve.log").read_text()


@pytest.mark.parametrize(
    "scheduler_args",
    [
        ["--max-num-batched-tokens", "16"],  # one block per step
        ["--max-num-batched-tokens", "64"],
        ["--max-num-batched-tokens", "256"],
        # No chunked case at 2048: it would split no prompt (all 8 are 382 tokens), so its steps,
        # decodes beside whole prompts, are ones budget256 plans too; unchunked keeps 2048's size
        ["--max-num-batched-tokens", "2048", "--no-enable-chunked-prefill"],
        ["--max-num-batched-tokens", "auto", "--target-itl-ms", "120"],  # a budget that moves every step
        ["--max-num-batched-tokens", "64", "--async-output-processing"],  # output served after the next send
        [  # step N+1 planned and sent while N runs, and drafts verified in decode steps (issue 34):
            # one server for both keeps the suite's time (a request drafts only every other step
            # under async scheduling, so plain async steps run too)
            "--max-num-batched-tokens",
            "64",
            "--async-scheduling",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}',
        ],
        # decode plans of up to 6 steps once every prompt is in, shrinking as requests near their end
        ["--max-num-batched-tokens", "64", "--num-scheduler-steps", "6"],
    ],
    ids=[
        "budget16",
        "budget64",
        "budget256",
        "unchunked",
        "auto",
        "async-output",
        "async-scheduling-speculative",
        "multi-step",
    ],
)
def test_greedy_tokens_do_not_depend_on_chunking(
    default_model_path, prompts, expected, penalized, tmp_path, scheduler_args
):
    """All prompts at once, so steps mix prefill chunks and decodes differently per budget;
    one more request with penalties and a bad word, whose tokens must not depend on it either."""
    from chunkserve.launch import start_server

    server = start_server(
        tmp_path,
        [
            "--model",
            str(default_model_path),
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--kv-cache-memory-gib",
            "0.1",
        ],
        scheduler_args + ["--max-num-seqs", "32"],
    )
    try:
        stub = server.stub()
        requests = [greedy(p) for p in prompts] + [penalized[0]]
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(lambda r: run(stub, r).token_ids, requests))
        assert got == expected + [penalized[1]]
        server.assert_idle_and_no_leaks()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("mode", "extra"),
    [("recompute", []), ("swap", []), ("swap", ["--async-scheduling"])],
    ids=["recompute", "swap", "swap-async-scheduling"],
)
def test_forced_preemption_gives_the_same_tokens(
    default_model_path, prompts, expected, penalized, tmp_path, mode, extra
):
    """A 16-block pool (256 tokens) for 6 concurrent requests of 49..232 tokens (one with
    penalties and a bad word, which a recompute must send its output so far): preemption is certain; greedy
    tokens must not change (under async scheduling a victim may be in the step in flight when
    it is preempted)."""
    import urllib.request

    from chunkserve.launch import start_server

    server = start_server(
        tmp_path,
        [
            "--model",
            str(default_model_path),
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--num-gpu-blocks-override",
            "16",
            "--swap-space",
            "0.05",
        ],
        ["--max-num-batched-tokens", "64", "--preemption-mode", mode, *extra],
    )
    try:
        stub = server.stub()
        requests = [greedy(p) for p in prompts[3:]] + [penalized[0]]
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(lambda r: run(stub, r).token_ids, requests))
        assert got == expected[3:] + [penalized[1]]
        server.assert_idle_and_no_leaks()
        metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("chunkserve_") and "{" in line
        }
        assert values["chunkserve_num_preemptions_total"] > 0
        swapped = values["chunkserve_kv_blocks_swapped_out_total"]
        assert (swapped > 0) == (mode == "swap")
        if mode == "swap":
            assert values["chunkserve_kv_blocks_swapped_in_total"] == swapped
    finally:
        server.stop()


@pytest.mark.parametrize("shared", [40, 48, None], ids=["inside-block", "at-boundary", "whole-prompt"])
def test_prefix_cache_hits_give_the_same_tokens(server, hf, shared):
    """A shared system prefix (or the whole prompt again): the second request is served
    from cached blocks and must still equal transformers exactly."""
    ids = hf[1](TEXT, add_special_tokens=False)["input_ids"]
    first = ids[100 : 100 + (shared or 70)] + ids[:20]
    second = first if shared is None else ids[100 : 100 + shared] + ids[20:50]
    stub = server.stub()
    run(stub, greedy(first))
    done = run(stub, greedy(second))
    common = len(second) - 1 if shared is None else shared
    assert done.usage.cached_tokens == common // BLOCK * BLOCK > 0
    assert done.token_ids == hf_greedy(hf, second, NEW_TOKENS)
    salted = run(stub, greedy(second, cache_salt=f"tenant-{shared}"))  # a tenant new to the cache
    assert salted.usage.cached_tokens == 0 and salted.token_ids == done.token_ids
    penalized = run(stub, greedy(second, **PENALTIES))  # starts on cached blocks: the prompt it skips counts
    assert penalized.usage.cached_tokens >= done.usage.cached_tokens  # `second` itself is cached now
    assert penalized.token_ids == hf_penalized(hf[0], second, NEW_TOKENS, **PENALTIES)


def test_hot_swap_policy_and_budget_under_load(server, prompts, expected):
    """32 streams; the policy changes twice and the budget once while they run. Every request
    completes with the undisturbed tokens, and the trace shows each change at a step boundary.

    Nothing depends on timing: a "keeper" stream that runs until it is cancelled keeps the
    engine stepping, each update is sent only once a step planned under the previous one is
    in the trace (so each setting runs at least one step), and every traced step must carry
    the settings in force at its step id. Waits have generous deadlines that only turn a
    hang into a failure; the trace may drop steps when its reader falls behind, so no check
    needs a particular step."""
    import threading

    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    deadline_s = 300.0
    admin = pb_grpc.AdminStub(grpc.insecure_channel(server.admin_address))
    traces: list[pb.StepTrace] = []
    watch = admin.WatchSteps(pb.WatchStepsRequest())

    def collect():
        try:
            for trace in watch:
                traces.append(trace)
        except grpc.RpcError:
            pass

    def first_step_from(step_id: int) -> pb.StepTrace:
        """The first traced step numbered step_id or later (waits for it)."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            found = [t for t in list(traces) if t.step_id >= step_id]
            if found:
                return min(found, key=lambda t: t.step_id)
            time.sleep(0.01)
        raise AssertionError(f"no step >= {step_id} traced within {deadline_s} s")

    threading.Thread(target=collect, daemon=True).start()
    stub = server.stub()
    # Keeps the engine stepping (one decode per step) until cancelled; its tokens are not checked.
    keeper = stub.Generate(build_request(prompts[0], temperature=0.0, max_tokens=2000, ignore_eos=True))
    started = threading.Semaphore(0)

    def generate(prompt) -> list[int]:
        out = Completion()
        for i, msg in enumerate(stub.Generate(greedy(prompt), timeout=600)):
            out.add(msg)
            if i == 0:
                started.release()
        return out.token_ids

    updates = [
        pb.SchedulingConfig(policy="sjf"),
        pb.SchedulingConfig(max_num_batched_tokens=64),
        pb.SchedulingConfig(policy="priority"),
    ]
    settings = [("fcfs", BUDGET), ("sjf", BUDGET), ("sjf", 64), ("priority", 64)]
    applied = []
    restored = None
    try:
        next(keeper)
        first_step_from(0)  # the trace subscription is live
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(generate, p) for p in prompts * 4]
            for _ in futures:  # every stream has its first token: all 32 are in
                assert started.acquire(timeout=deadline_s), "a stream never started"
            for update, after in zip(updates, settings[1:]):
                answer = admin.UpdateConfig(update, timeout=30)
                applied.append(answer)
                assert (answer.policy, answer.max_num_batched_tokens) == after
                # The step the change applies from (or the first one traced after it) runs
                # under the new settings; only then is the next change sent.
                step = first_step_from(answer.effective_step)
                assert (step.policy, step.token_budget) == after, f"step {step.step_id}"
            keeper.cancel()
            got = [f.result() for f in futures]
    finally:
        keeper.cancel()
        restored = admin.UpdateConfig(pb.SchedulingConfig(policy="fcfs", max_num_batched_tokens=BUDGET), timeout=30)
        watch.cancel()
    assert got == expected * 4
    assert all(t.num_tokens <= t.token_budget for t in traces)
    # Changes apply at step boundaries, in order: a step runs under the settings of the last
    # change whose effective step is at or before it (each change ran at least one step).
    boundaries = [a.effective_step for a in applied]
    assert boundaries == sorted(set(boundaries)), boundaries
    for t in traces:
        if t.step_id < restored.effective_step:
            in_force = settings[sum(1 for b in boundaries if b <= t.step_id)]
            assert (t.policy, t.token_budget) == in_force, f"step {t.step_id}: boundaries {boundaries}"


def test_executor_killed_under_load_then_restarted(tiny_model_path, tmp_path):
    """kill -9 the executor mid-stream: every open stream ends UNAVAILABLE from the lost
    connection (well inside the 120 s step timeout, which would otherwise end them), health
    flips to NOT_SERVING, and once an executor is back new requests succeed on a clean pool."""
    import os
    import signal
    import subprocess

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from chunkserve.launch import start_server

    server = start_server(tmp_path, ["--model", str(tiny_model_path), "--dtype", "float32"], [])
    try:
        stub = server.stub()
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))

        def check():
            return health.Check(health_pb2.HealthCheckRequest(service="chunkserve.v1.Generation"), timeout=5).status

        assert check() == health_pb2.HealthCheckResponse.SERVING
        eport = server.executor.args[server.executor.args.index("--executor-port") + 1]
        executor_health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{eport}"))
        for name in ("", "chunkserve.executor.v1.Executor"):  # the standard service, for probes
            assert (
                executor_health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        calls = [
            stub.Generate(build_request([5, 6, 7], temperature=0.0, max_tokens=3000, ignore_eos=True)) for _ in range(6)
        ]
        for call in calls:
            next(m for m in call if m.token_ids)  # running
        executor_argv = server.executor.args
        os.kill(server.executor.pid, signal.SIGKILL)
        killed = time.time()
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Half the step timeout: a bound only a stream left to time out reaches, even on a
        # machine many times slower than this one (the lost connection ends them at once).
        assert time.time() - killed < 60
        deadline = time.time() + 60
        while check() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.time() < deadline
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as err:
            run(stub, build_request([5, 6], max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # What `chunkserve serve` or compose does: start the executor again, same flags.
        server.executor = subprocess.Popen(
            executor_argv,
            stdout=open(tmp_path / "executor2.log", "w"),
            stderr=subprocess.STDOUT,
            env=server.executor_env,
        )
        deadline = time.time() + 120
        while check() != health_pb2.HealthCheckResponse.SERVING:
            assert time.time() < deadline, (tmp_path / "executor2.log").read_text()[-2000:]
            time.sleep(0.2)
        done = run(stub, build_request([5, 6, 7], temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(done.token_ids) == 4
        server.assert_idle_and_no_leaks()
    finally:
        server.stop()


def test_prompt_logprobs_equal_transformers_across_chunks(server, hf, prompts):
    """A 200-token prompt prefilled in chunks of the 128-token budget: each prompt token's
    logprob (from the second on) and its top 2 equal transformers' log-softmax over the whole
    prompt; sent once, with the first token, with the prompt's ids. A second request of the
    same prompt is prefilled from token 0 again (the logits of cached blocks are gone)."""
    import torch

    prompt = prompts[-1]
    with torch.inference_mode():
        want = torch.log_softmax(hf[0](torch.tensor([prompt])).logits[0].float(), -1)
    stub = server.stub()
    for _ in range(2):
        done = run(stub, greedy(prompt, prompt_logprobs=2))
        assert done.prompt_token_ids == prompt and len(done.prompt_logprobs) == len(prompt) - 1
        assert done.usage.cached_tokens == 0
        for position, lp in enumerate(done.prompt_logprobs, start=1):
            row = want[position - 1]
            assert lp.logprob == pytest.approx(row[prompt[position]].item(), abs=2e-4)
            # its rank: 1 + tokens more likely, up to ties within float noise
            t = row[prompt[position]]
            assert 1 + int((row > t + 2e-4).sum()) <= lp.rank <= 1 + int((row > t - 2e-4).sum())
            assert [t.token_id for t in lp.top] == row.topk(2).indices.tolist()
        assert done.token_ids == run(stub, greedy(prompt)).token_ids  # the tokens do not change
