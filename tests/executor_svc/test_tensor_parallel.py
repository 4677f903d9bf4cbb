"""Tensor parallelism (executor_svc/tp_group.py) on CPU with gloo: a TP=2 group runs the same
plans as one process and samples the same greedy tokens; bad group sizes are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from chunkserve.launch import tiny_llama_config
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from executor_svc.config import ExecutorConfig
from executor_svc.replay import read_messages, write_messages

ROOT = Path(__file__).resolve().parents[2]
# On top of the tiny Llama: 8 heads, 4 KV heads, q/k/v/o and MLP biases, an odd vocabulary (padded to 2 x 64 rows).
TP_TINY = dict(
    hidden_size=128,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=127,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    attention_bias=True,
    mlp_bias=True,
)
BLOCK = 4
GREEDY = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=2)
PENALIZED = epb.SamplingParams(
    temperature=0.0, top_p=1.0, num_logprobs=2, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25
)


def write_model(path: Path, tied: bool, **overrides) -> Path:
    torch.manual_seed(0)
    config = tiny_llama_config(**{**TP_TINY, **overrides}, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norms and biases, so a dropped or doubled one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def entry(seq, computed, n, tokens=(), blocks=(), sample=True, replace=False):
    return epb.ScheduledSequence(
        seq_id=seq,
        num_computed_tokens=computed,
        num_new_tokens=n,
        token_ids=list(tokens),
        block_ids=list(blocks),
        sample=sample,
        replace_block_table=replace,
    )


def mixed_plans() -> list[epb.StepRequest]:
    """Chunked prefills next to decodes (B with penalties), a prefix-cache hit, a swap-out and swap-in, a
    finished sequence, a refused plan (which must change nothing on any rank), and a
    preemption by recompute: D is dropped (finished_seq_ids) and prefilled again from token 0,
    in two chunks, into a fresh block table (blocks C left behind, stale KV in them)."""
    g = torch.Generator().manual_seed(1)
    pa, pb, pd = (torch.randint(0, 127, (n,), generator=g).tolist() for n in (20, 6, 5))
    pc = pa[:8] + torch.randint(0, 127, (5,), generator=g).tolist()
    A, B, C, D, E = 1, 2, 3, 4, 5
    new = lambda *ids: [epb.NewSequence(seq_id=i, sampling=GREEDY) for i in ids]  # noqa: E731
    # B samples with penalties (rank 0 samples; every rank keeps its counts), swapped out and in
    penalized = [epb.NewSequence(seq_id=B, sampling=PENALIZED, prompt_token_ids=pb)]
    # A's first chunk reports prompt logprobs (the head runs on every rank for them)
    scored = [epb.NewSequence(seq_id=A, sampling=epb.SamplingParams(top_p=1.0, num_logprobs=-1, num_prompt_logprobs=3))]
    first = entry(A, 0, 8, pa[:8], [0, 1], sample=False)
    first.prompt_logprob_rows, first.next_token_id = 8, pa[8]
    steps = [
        dict(new_seqs=scored, seqs=[first]),
        dict(new_seqs=penalized, seqs=[entry(A, 8, 8, pa[8:16], [2, 3], sample=False), entry(B, 0, 6, pb, [4, 5])]),
        dict(seqs=[entry(A, 16, 4, pa[16:], [6]), entry(B, 6, 1)]),
        dict(new_seqs=new(C), seqs=[entry(A, 20, 1, blocks=[7]), entry(B, 7, 1), entry(C, 8, 5, pc[8:], [0, 1, 8, 9])]),
        dict(
            swap_out=[epb.BlockCopy(src=4, dst=0), epb.BlockCopy(src=5, dst=1)], seqs=[entry(A, 21, 1), entry(C, 13, 1)]
        ),
        # refused (a token id outside the vocabulary): no rank may move a cursor
        dict(new_seqs=new(E), seqs=[entry(A, 22, 1), entry(E, 0, 2, [5, 200], [20])]),
        dict(seqs=[entry(A, 22, 1), entry(C, 14, 1)]),
        dict(
            swap_in=[epb.BlockCopy(src=0, dst=10), epb.BlockCopy(src=1, dst=11)],
            seqs=[entry(A, 23, 1), entry(C, 15, 1), entry(B, 8, 1, blocks=[10, 11, 12], replace=True)],
        ),
        dict(seqs=[entry(A, 24, 1, blocks=[13]), entry(C, 16, 1, blocks=[14]), entry(B, 9, 1)]),
        dict(finished_seq_ids=[C], seqs=[entry(A, 25, 1), entry(B, 10, 1)]),
        dict(new_seqs=new(D), seqs=[entry(A, 26, 1), entry(B, 11, 1), entry(D, 0, 5, pd, [15, 16])]),
        dict(seqs=[entry(A, 27, 1), entry(B, 12, 1, blocks=[17]), entry(D, 5, 1)]),
        dict(seqs=[entry(A, 28, 1, blocks=[18]), entry(B, 13, 1), entry(D, 6, 1)]),
        # recompute: D's state and blocks 15, 16 are dropped; the same prompt again from token 0
        dict(
            finished_seq_ids=[D],
            new_seqs=new(D),
            seqs=[entry(A, 29, 1), entry(B, 14, 1), entry(D, 0, 3, pd[:3], [8], sample=False)],
        ),
        dict(seqs=[entry(A, 30, 1), entry(B, 15, 1), entry(D, 3, 2, pd[3:], [9])]),
        dict(seqs=[entry(A, 31, 1), entry(D, 5, 1)]),
    ]
    return [epb.StepRequest(step_id=i, **s) for i, s in enumerate(steps)]


def replay(model: Path, tp: int, tmp: Path, plans: list[epb.StepRequest]) -> list[epb.StepResponse]:
    plans_file, out = tmp / f"plans-{tp}.bin", tmp / f"out-{tp}.bin"
    write_messages(plans_file, plans)
    cmd = [sys.executable, "-m", "executor_svc.replay", "--plans", str(plans_file), "--out", str(out)]
    cmd += ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--block-size", str(BLOCK)]
    cmd += ["--num-gpu-blocks-override", "32", "--swap-space", "0.001", "--num-threads", "1"]
    cmd += ["--tensor-parallel-size", str(tp), "--tensor-parallel-timeout-s", "120"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    if tp > 1:  # really a group: every rank loaded its shard and sized the same KV cache
        for rank in range(tp):
            assert f"rank {rank} of {tp}: loaded" in done.stderr
    return list(read_messages(out, epb.StepResponse))


def tokens(responses: list[epb.StepResponse]) -> list[list[tuple[int, int]]]:
    return [[(s.seq_id, s.token_id) for s in r.sampled] for r in responses]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp2_greedy_tokens_equal_tp1_on_mixed_steps(tmp_path, tied):
    model = write_model(tmp_path / "model", tied)
    plans = mixed_plans()
    one, two = replay(model, 1, tmp_path, plans), replay(model, 2, tmp_path, plans)
    assert tokens(one) == tokens(two)
    # every plan ran but the refused one (step 5), which sampled nothing, on both
    assert [len(t) for t in tokens(one)] == [0, 1, 2, 3, 2, 0, 2, 3, 3, 2, 3, 3, 3, 2, 3, 2]
    # after the recompute D samples what it sampled the first time (steps 10, 11 -> 14, 15)
    d = {i: dict(t)[4] for i, t in enumerate(tokens(one)) if 4 in dict(t)}
    assert [d[14], d[15]] == [d[10], d[11]]
    assert [p.position for p in one[0].prompt_logprobs] == list(range(1, 9))
    for p1, p2 in zip(one[0].prompt_logprobs, two[0].prompt_logprobs, strict=True):
        assert (p1.position, p1.token_id) == (p2.position, p2.token_id)
        assert p2.logprob == pytest.approx(p1.logprob, abs=1e-4)
    for r1, r2 in zip(one, two):
        for s1, s2 in zip(r1.sampled, r2.sampled):
            assert s2.logprob == pytest.approx(s1.logprob, abs=1e-4)
            assert [t.token_id for t in s2.top] == [t.token_id for t in s1.top]


def test_tp_size_that_does_not_divide_kv_heads_is_refused(tmp_path):
    model = write_model(tmp_path / "model", False, num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(model), "--device", "cpu"]
    cmd += ["--tensor-parallel-size", "2", "--executor-port", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--tensor-parallel-size 2 does not divide" in done.stderr
    assert "num_attention_heads 6, num_key_value_heads 3" in done.stderr
    assert "Traceback" not in done.stderr


def test_config_validates_tp_flags():
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        ExecutorConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--quantization int4 is not supported with --tensor-parallel-size 2"):
        ExecutorConfig(tensor_parallel_size=2, quantization="int4")
    assert ExecutorConfig(quantization="int4").tensor_parallel_size == 1


@pytest.mark.parametrize("argv", [["-tp", "2"], ["--tensor-parallel-size", "2"]])
def test_chunkserve_serve_takes_vllms_tp_spelling(argv):
    import argparse

    from chunkserve.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", *argv]).tensor_parallel_size == 2


@pytest.mark.slow
def test_tp2_executor_serves_a_scheduler_and_a_dead_rank_ends_the_group(tiny_model_path, tmp_path):
    """A real TP=2 executor (rank 0 starts rank 1) behind a real scheduler: the same greedy
    tokens as TP=1, the handshake says 2, a reset and an idle spell longer than the
    collectives' timeout leave the group working; SIGKILL of rank 1 ends rank 0 at once, so
    open streams end UNAVAILABLE at once (not at the timeout), as when a single executor dies."""
    import os
    import signal
    import time

    import grpc

    from chunkserve.client import build_request
    from chunkserve.launch import child_pids, start_server
    from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc

    def generate(server, prompt):
        done = list(server.stub().Generate(build_request(prompt, temperature=0.0, max_tokens=8, ignore_eos=True)))
        return [t for m in done for t in m.token_ids]

    prompts = [[5, 6, 7], list(range(100, 140)), [9] * 20]
    common = ["--model", str(tiny_model_path), "--dtype", "float32", "--device", "cpu", "--block-size", "4"]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = start_server(tmp_path / "one", [*common, "--num-threads", "1"], ["--max-num-batched-tokens", "16"])
    try:
        expected = [generate(one, p) for p in prompts]
    finally:
        one.stop()
    two = start_server(
        tmp_path / "two",
        [*common, "--num-threads", "1", "--tensor-parallel-size", "2", "--tensor-parallel-timeout-s", "20"],
        ["--max-num-batched-tokens", "16"],
    )
    try:
        eport = two.executor.args[two.executor.args.index("--executor-port") + 1]
        executor = epb_grpc.ExecutorStub(grpc.insecure_channel(f"127.0.0.1:{eport}"))
        auth = [("authorization", f"Bearer {two.token}")]
        assert executor.Handshake(epb.HandshakeRequest(), metadata=auth, timeout=10).tensor_parallel_size == 2
        assert two.stub().GetInfo(pb.GetInfoRequest(), timeout=10).tensor_parallel_size == 2
        with concurrent_calls() as pool:  # concurrent: chunked prefills next to decodes
            assert list(pool.map(lambda p: generate(two, p), prompts)) == expected
        executor.Reset(epb.ResetRequest(), metadata=auth, timeout=30)  # reaches rank 1 too: the group goes on
        # Idle for longer than the collectives' timeout: rank 0's keepalive keeps rank 1 waiting.
        time.sleep(25)
        assert generate(two, prompts[0]) == expected[0]
        calls = [two.stub().Generate(build_request([5, 6], temperature=0.0, max_tokens=3000, ignore_eos=True))]
        next(m for m in calls[0] if m.token_ids)  # running
        [rank1] = child_pids(two.executor.pid)
        os.kill(rank1, signal.SIGKILL)
        killed = time.time()
        with pytest.raises(grpc.RpcError) as err:
            for _ in calls[0]:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Ended by the death itself, not by the collectives' 20 s timeout (about 1 s here; the
        # bound is the timeout, so a machine several times slower still passes).
        assert time.time() - killed < 20
        assert two.executor.wait(10) == 3  # tp_group.EXIT_GROUP_LOST
    finally:
        two.stop()


def concurrent_calls():
    import concurrent.futures

    return concurrent.futures.ThreadPoolExecutor(max_workers=3)


@pytest.mark.slow
def test_default_model_tp3_equals_tp1(default_model_path, tmp_path):
    """SmolLM2-135M (9 heads, 3 KV heads, intermediate 1536, vocab 49152) split 3 ways: a
    chunked prefill and a few decodes give TP=1's greedy tokens (TP=1 equals HF: test_llama)."""
    prompt = [1, 504, 3458, 282, 4649, 314, 2114, 30, 378, 6459, 3263, 314]
    new = [epb.NewSequence(seq_id=1, sampling=GREEDY)]
    plans = [
        epb.StepRequest(step_id=0, new_seqs=new, seqs=[entry(1, 0, 8, prompt[:8], [0, 1], sample=False)]),
        epb.StepRequest(step_id=1, seqs=[entry(1, 8, 4, prompt[8:], [2])]),
        *(
            epb.StepRequest(step_id=2 + k, seqs=[entry(1, 12 + k, 1, blocks=[3 + k // 4] if k % 4 == 0 else [])])
            for k in range(5)
        ),
    ]
    one, three = replay(default_model_path, 1, tmp_path, plans), replay(default_model_path, 3, tmp_path, plans)
    assert [len(t) for t in tokens(one)] == [0, 1, 1, 1, 1, 1, 1]
    assert tokens(one) == tokens(three)


@pytest.mark.slow
def test_serve_restarts_the_whole_group_after_a_rank_dies(tiny_model_path, tmp_path):
    """`chunkserve serve --tensor-parallel-size 2`: SIGKILL of rank 1 ends rank 0 (status 3),
    the open stream ends UNAVAILABLE, and `chunkserve serve` starts a new group (a new rank 0
    that starts its own rank 1); the scheduler serves again with the same greedy tokens.
    Every wait is for a state, bounded by a deadline that only a failure reaches."""
    import os
    import signal
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from chunkserve.client import build_request
    from chunkserve.launch import child_pids, free_port
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    log = tmp_path / "serve.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSERVE_")}
    env.update(
        PYTHONUNBUFFERED="1",
        CHUNKSERVE_PORT=str(port),
        CHUNKSERVE_EXECUTOR_PORT=str(free_port()),
        CHUNKSERVE_METRICS_PORT="0",
        CHUNKSERVE_ADMIN_PORT="0",
        CHUNKSERVE_HTTP_PORT="0",
    )
    cmd = [sys.executable, "-m", "chunkserve.cli", "serve", "--model", str(tiny_model_path), "--host", "127.0.0.1"]
    cmd += ["--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "64", "--num-threads", "1"]
    cmd += ["--tensor-parallel-size", "2", "--tensor-parallel-timeout-s", "60"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def wait_for(predicate, what, deadline_s=300.0):
        """Polls until `predicate`; the deadline is a failsafe against a hang (a restart takes up
        to the 60 s collectives' timeout plus a reload), not a time limit."""
        deadline = time.monotonic() + deadline_s
        while not predicate():
            assert proc.poll() is None, f"chunkserve serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"{what}: not within {deadline_s:g} s\n{log.read_text()[-4000:]}"
            time.sleep(0.1)

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub, health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)

    def serving() -> bool:
        request = health_pb2.HealthCheckRequest(service="chunkserve.v1.Generation")
        try:
            return health.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def generate() -> list[int]:
        request = build_request([5, 6, 7], temperature=0.0, max_tokens=6, ignore_eos=True)
        return [t for m in stub.Generate(request, timeout=60) for t in m.token_ids]

    try:
        wait_for(lambda: "serving on" in log.read_text(), "chunkserve serve ready")
        assert serving()
        before = generate()
        assert len(before) == 6
        [rank0] = child_pids(proc.pid)
        [rank1] = child_pids(rank0)
        # max_model_len is 64 blocks x 16 tokens: this stream is still running at the kill
        call = stub.Generate(build_request([5, 6], temperature=0.0, max_tokens=1000, ignore_eos=True))
        next(m for m in call if m.token_ids)
        os.kill(rank1, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The scheduler noticed (it logs this after going NOT_SERVING), and serve restarted the group.
        wait_for(lambda: "executor lost" in log.read_text(), "the scheduler sees the executor gone")
        wait_for(lambda: "the executor exited with code 3; restarting it" in log.read_text(), "serve restarts it")
        wait_for(lambda: [p for p in child_pids(proc.pid) if p != rank0], "a new rank 0")
        [new_rank0] = child_pids(proc.pid)
        wait_for(lambda: len(child_pids(new_rank0)) == 1, "the new rank 0 starts its rank 1")
        wait_for(serving, "SERVING again")
        assert generate() == before
        assert stub.GetInfo(pb.GetInfoRequest(), timeout=10).tensor_parallel_size == 2
        assert log.read_text().count("restarting it") == 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.slow  # three executor processes, ~35 s
def test_tp2_masked_greedy_tokens_equal_tp1_and_stay_in_the_masks(tmp_path):
    """Structured output under TP: every sampling entry of the mixed plans carries a token mask
    row (rank 0 samples with it; the vocabulary is 127, padded to 128 rows across ranks, so
    the padding row must stay out too): the same tokens as one process, each allowed."""
    model = write_model(tmp_path / "model", tied=False)
    vocab = TP_TINY["vocab_size"]

    def allowed(seq: int) -> set[int]:
        return {t for t in range(vocab) if t % 5 == seq % 5}

    def row(ids: set[int]) -> bytes:
        words = [0] * ((vocab + 31) // 32)
        for t in ids:
            words[t // 32] |= 1 << (t % 32)
        return b"".join(w.to_bytes(4, "little") for w in words)

    plans = mixed_plans()
    for plan in plans:
        for s in plan.seqs:
            if s.sample:
                s.token_masks.add(position=s.num_new_tokens - 1, bits=row(allowed(s.seq_id)))
    one, two = replay(model, 1, tmp_path, plans), replay(model, 2, tmp_path, plans)
    assert tokens(one) == tokens(two)
    assert sum(len(t) for t in tokens(one)) == 34
    assert all(token in allowed(seq) for step in tokens(one) for seq, token in step)
    (tmp_path / "free").mkdir()
    free = tokens(replay(model, 1, tmp_path / "free", mixed_plans()))
    assert free != tokens(one)  # the masks changed what was sampled


@pytest.mark.slow  # three executor processes, ~35 s
def test_tp2_verify_steps_keep_the_same_tokens_and_cursors_as_tp1(tmp_path):
    """Speculative decoding under TP: rank 0 samples every row of a verify entry and shares the
    ids, and every rank keeps the same accepted prefix and moves its cursor back alike. Mask
    rows of one token each make acceptance certain: all three drafts, then one of three; the
    plans after them only run if both processes' cursors are where the scheduler puts them."""
    model = write_model(tmp_path / "model", tied=False)
    vocab = TP_TINY["vocab_size"]

    def only(t: int) -> bytes:
        words = [0] * ((vocab + 31) // 32)
        words[t // 32] |= 1 << (t % 32)
        return b"".join(w.to_bytes(4, "little") for w in words)

    def verify(step, computed, drafts, forced, blocks=()):
        s = entry(1, computed, 1 + len(drafts), blocks=blocks)
        s.draft_token_ids.extend(drafts)
        for position, t in enumerate(forced):
            s.token_masks.add(position=position, bits=only(t))
        return epb.StepRequest(step_id=step, seqs=[s])

    plans = [
        epb.StepRequest(
            step_id=0,
            new_seqs=[
                epb.NewSequence(seq_id=1, sampling=epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1))
            ],
            seqs=[entry(1, 0, 6, [3, 14, 15, 92, 65, 35], [0, 1])],
        ),
        verify(1, 6, [8, 9, 10], [8, 9, 10, 11], [2]),  # all accepted: 8 9 10 and 11, cursor 10
        verify(2, 10, [12, 13, 14], [12, 20], [3]),  # 12 accepted, 20 sampled instead of 13: cursor 12
        epb.StepRequest(step_id=3, seqs=[entry(1, 12, 1)]),  # free decodes after the rollback
        epb.StepRequest(step_id=4, seqs=[entry(1, 13, 1, blocks=[4])]),
    ]
    one, two = replay(model, 1, tmp_path, plans), replay(model, 2, tmp_path, plans)
    assert tokens(one) == tokens(two)
    got = [t for _, t in sum(tokens(one), [])]
    assert got[1:7] == [8, 9, 10, 11, 12, 20] and len(got) == 9  # every plan ran: the cursors held


@pytest.mark.slow  # three executor processes, ~35 s
def test_tp2_multi_step_plans_equal_one_step_plans(tmp_path):
    """Multi-step plans (StepRequest.num_steps) under TP: every rank derives the same decode
    plans and rank 0 shares each step's ids, so TP 2 samples what TP 1 does, and both what
    one-step plans sample (a greedy and a penalized sequence); the plan after them runs only if
    every rank's cursors are where the scheduler puts them."""
    model = write_model(tmp_path / "model", tied=True)
    g = torch.Generator().manual_seed(3)
    pa, pb = (torch.randint(0, 127, (n,), generator=g).tolist() for n in (7, 9))

    def prefill() -> epb.StepRequest:
        news = [
            epb.NewSequence(seq_id=1, sampling=GREEDY),
            epb.NewSequence(seq_id=2, sampling=PENALIZED, prompt_token_ids=pb),
        ]
        return epb.StepRequest(
            step_id=0, new_seqs=news, seqs=[entry(1, 0, 7, pa, [0, 1, 2, 3]), entry(2, 0, 9, pb, [4, 5, 6, 7])]
        )

    multi = [
        prefill(),
        epb.StepRequest(step_id=1, num_steps=5, seqs=[entry(1, 7, 1), entry(2, 9, 1)]),  # positions 7..11, 9..13
        epb.StepRequest(step_id=2, seqs=[entry(1, 12, 1), entry(2, 14, 1, blocks=[8])]),
    ]
    single = [prefill()] + [
        epb.StepRequest(step_id=1 + k, seqs=[entry(1, 7 + k, 1), entry(2, 9 + k, 1, blocks=[8] if k == 5 else [])])
        for k in range(6)
    ]
    one, two, plain = (
        replay(model, 1, tmp_path, multi),
        replay(model, 2, tmp_path, multi),
        replay(model, 1, tmp_path, single),
    )
    assert tokens(one) == tokens(two) and [r.num_steps for r in two] == [1, 5, 1]
    per_seq = lambda responses: {s: [t for r in responses for q, t in tokens([r])[0] if q == s] for s in (1, 2)}  # noqa: E731
    assert per_seq(one) == per_seq(plain) and len(per_seq(one)[1]) == 7
