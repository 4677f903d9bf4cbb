"""How far `--quantization int4` and the CPU 16-bit modes (`--dtype bfloat16` / `float16`) are
from float32 on the default model (issue 18, item 3).

Two measurements, both against float32 on the same weights:

1. Teacher-forced, over every position of a fixed text set (English prose, French, German,
   Russian, Chinese, Python code, and one ~1500-token passage): top-1 agreement (the fraction
   of positions where the int4 path's argmax equals float32's) and perplexity of each text.
   Computed with Hugging Face's model on the same float32 weights, float32 as is and with the
   int4 path emulated: every decoder linear multiplies bfloat16-rounded activations by exactly
   the weights the int4 kernel uses (`int4_reference`) and rounds its output to bfloat16 as the
   kernel does; the head is a bfloat16 linear (16-bit modes: activations and weights rounded to
   the 16-bit type, a 16-bit GEMM through `half_linear`, its output widened, as
   models/quant.HalfWeights computes it; the head the same). That is the arithmetic of a step
   the mode's row rule sends to the reduced copy; it differs from the kernel only in summation order
   (tests/executor_svc/test_quant.py checks kernel == reference to float32 rounding).
2. Greedy generation through the real executor (`ModelRunner` as the server loads it, float32
   and int4): each prompt prefilled (chunks above --quantized-max-rows run the float32 path),
   then GEN tokens decoded one step at a time (the int4 path); reported: identical
   continuations and the mean length of the common prefix.

    timeout 1800 .venv/bin/python benchmarks/quantization_quality.py [--gen 32] [--modes int4 bfloat16 float16]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from chunkserve.bench.workloads import corpus_text
from executor_svc.config import ExecutorConfig, default_cache_dir
from executor_svc.model_loader import resolve_model
from executor_svc.models.quant import half_linear, int4_reference

TEXTS = {
    "english": "The old lighthouse keeper climbed the spiral stairs every evening, counting each step as his "
    "father had taught him, and when he reached the lamp room he wiped the salt from the glass.",
    "french": "La ville s'éveillait lentement sous une pluie fine. Les marchands installaient leurs étals sur "
    "la place, et l'odeur du pain chaud se mêlait à celle des pavés mouillés.",
    "german": "Am Morgen fuhren wir mit dem Zug in die Berge. Der Schnee lag noch auf den Gipfeln, und die "
    "Bäche rauschten laut, weil es in der Nacht geregnet hatte.",
    "russian": "Вечером мы сидели у костра и слушали, как ветер шумит в соснах. Дед рассказывал истории о "
    "своей молодости, а мы смотрели на звёзды.",
    "chinese": "春天来了，公园里的花都开了。孩子们在草地上放风筝，老人们坐在长椅上聊天，湖面上有几只白色的小船。",
    "code": "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
}
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explique en une phrase ce qu'est la photosynthèse.",
    "Wie viele Tage hat ein Schaltjahr?",
    "def fibonacci(n):",
    "Translate to Spanish: The weather is nice today.",
    "List three uses of copper.",
    "请用一句话介绍长城。",
]


def emulate_int4(model: torch.nn.Module) -> None:
    """Replaces the decoder linears and the head of an HF Llama by the int4 path's arithmetic."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for lin in list(parent.children()):
                if isinstance(lin, torch.nn.Linear):
                    ref = int4_reference(lin.weight)
                    bias = lin.bias

                    def forward(x, ref=ref, bias=bias):
                        y = F.linear(x.to(torch.bfloat16).float(), ref).to(torch.bfloat16).float()
                        return y if bias is None else y + bias

                    lin.forward = forward
    head = model.lm_head
    w16 = head.weight.detach().to(torch.bfloat16)
    head.forward = lambda x: F.linear(x.to(torch.bfloat16), w16).float()


def emulate_half(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Replaces the decoder linears and the head of an HF Llama by the 16-bit path's arithmetic
    (`HalfWeights.matmul`: x and W rounded to `dtype`, a `dtype` GEMM, the result widened)."""
    lins = [lin for layer in model.model.layers for p in (layer.self_attn, layer.mlp) for lin in p.children()]
    for lin in [x for x in lins if isinstance(x, torch.nn.Linear)] + [model.lm_head]:
        w16, bias = lin.weight.detach().to(dtype), lin.bias

        def forward(x, w16=w16, bias=bias):
            y = half_linear(x.reshape(-1, x.shape[-1]).to(w16.dtype), w16).float().reshape(*x.shape[:-1], -1)
            return y if bias is None else y + bias

        lin.forward = forward


def emulate(model: torch.nn.Module, mode: str) -> None:
    if mode == "int4":
        emulate_int4(model)
    else:
        emulate_half(model, {"bfloat16": torch.bfloat16, "float16": torch.float16}[mode])


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return math.exp(-lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def greedy(runner, prompt: list[int], gen: int, margins: list[float] | None = None) -> list[int]:
    """`gen` greedy tokens after `prompt` through the executor; with `margins`, appends each
    token's lead over the runner-up (logprob difference, nats)."""
    from chunkserve_contracts.executor.v1 import executor_pb2 as epb

    runner.reset()
    params = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1 if margins is None else 2)
    blocks = list(range(-(-(len(prompt) + gen) // runner.block_size)))
    plan = epb.StepRequest(step_id=0)
    plan.new_seqs.add(seq_id=1, sampling=params)
    plan.seqs.add(seq_id=1, num_computed_tokens=0, num_new_tokens=len(prompt), token_ids=prompt, block_ids=blocks)
    plan.seqs[0].sample = True
    out = []
    for k in range(gen):
        if k:
            plan = epb.StepRequest(step_id=k)
            plan.seqs.add(seq_id=1, num_computed_tokens=len(prompt) + k - 1, num_new_tokens=1, sample=True)
        sampled = runner.execute(plan).sampled[0]
        out.append(sampled.token_id)
        if margins is not None:
            margins.append(sampled.top[0].logprob - sampled.top[1].logprob)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--modes", nargs="+", default=["int4", "bfloat16", "float16"], choices=["int4", "bfloat16", "float16"]
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("default", default_cache_dir())
    tok = AutoTokenizer.from_pretrained(path)
    texts = dict(TEXTS)
    long_ids = tok(corpus_text())["input_ids"][:1500]
    texts["long (1500 tokens)"] = tok.decode(long_ids)

    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for mode in args.modes:
        q = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        emulate(q, mode)
        print(f"\n{'text':22}{'tokens':>8}{'top-1 agree':>13}{'ppl fp32':>11}{'ppl ' + mode:>13}{'ratio':>8}")
        agree_all, n_all, nll32, nllq = 0, 0, 0.0, 0.0
        for name, text in texts.items():
            ids = tok(text)["input_ids"]
            a, b = teacher_forced(fp32, ids), teacher_forced(q, ids)
            agree = (a.argmax(-1) == b.argmax(-1)).float()
            p32, pq = perplexity(a, ids), perplexity(b, ids)
            agree_all += int(agree.sum())
            n_all += len(ids)
            nll32 += math.log(p32) * (len(ids) - 1)
            nllq += math.log(pq) * (len(ids) - 1)
            print(f"{name:22}{len(ids):8d}{agree.mean().item():13.3f}{p32:11.3f}{pq:13.3f}{pq / p32:8.3f}")
        n_pred = n_all - len(texts)
        print(
            f"{'all':22}{n_all:8d}{agree_all / n_all:13.3f}{math.exp(nll32 / n_pred):11.3f}"
            f"{math.exp(nllq / n_pred):13.3f}{math.exp((nllq - nll32) / n_pred):8.3f}"
        )
        del q
    del fp32

    from executor_svc.worker import load

    def runner(mode: str):
        cfg = ExecutorConfig(
            model="default",
            dtype=mode if mode in ("bfloat16", "float16") else "float32",
            device="cpu",
            kv_cache_memory_gib=0.25,
            swap_space=0.0,
            cache_dir=default_cache_dir(),
            num_threads=args.threads,
            quantization="int4" if mode == "int4" else "none",
        )
        return load(cfg).runner

    chat = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    chat = [list(c["input_ids"]) if isinstance(c, dict) or hasattr(c, "keys") else list(c) for c in chat]
    with torch.inference_mode():
        r = runner("float32")
        base = [greedy(r, p, args.gen) for p in chat]
        del r
        for mode in args.modes:
            r = runner(mode)
            quant = [greedy(r, p, args.gen) for p in chat]
            del r
            prefixes = []
            for a, b in zip(base, quant):
                n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                prefixes.append(n)
            same = sum(n == args.gen for n in prefixes)
            print(
                f"\n{mode}: greedy through the executor, {len(chat)} chat prompts x {args.gen} tokens: {same}/{len(chat)} "
                f"identical, common prefix mean {statistics.mean(prefixes):.1f} tokens (per prompt: {prefixes})"
            )
            for p, a, b, n in zip(PROMPTS, base, quant, prefixes):
                if n < args.gen:
                    print(f"  {p!r}: fp32 {tok.decode(a)!r}\n  {'':{len(repr(p))}}  {mode} {tok.decode(b)!r}")


if __name__ == "__main__":
    main()
