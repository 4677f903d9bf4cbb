"""What validating a whole plan costs the executor: the plan bookkeeping (validation + state
update) of a 32-decode step, and a whole execute() of it for scale, on a tiny random Llama
(2 layers, hidden 64) with 1000-token contexts, one torch thread. Medians and minimums over
thousands of runs; the runner's state is reset between runs.

    .venv/bin/python benchmarks/plan_validation_cost.py [context length, default 1000]

It also runs against the runner before validate-then-apply (08226e3), which had no
`validate`, when that tree is first on PYTHONPATH (its bookkeeping was _swap + _collect).
"""

import statistics
import sys
import tempfile
import time

import torch
import transformers

import executor_svc.runner as R
from chunkserve.launch import tiny_llama_config
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.config import ExecutorConfig
from executor_svc.worker import load

print("runner:", R.__file__)
torch.set_num_threads(1)
CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
path = tempfile.mkdtemp()
torch.manual_seed(0)
cfg = tiny_llama_config(max_position_embeddings=4096)
transformers.LlamaForCausalLM(cfg).save_pretrained(path)
loaded = load(
    ExecutorConfig(
        model=path,
        dtype="float32",
        block_size=16,
        num_gpu_blocks_override=2200,
        swap_space=0.0,
        max_num_batched_tokens=4096,
        cache_dir=path + "/cache",
    )
)
runner = loaded.runner
G = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
nb = -(-CTX // 16)
for k in range(0, 32, 4):
    plan = epb.StepRequest(step_id=k)
    for sid in range(k, k + 4):
        plan.new_seqs.add(seq_id=sid, sampling=G)
        plan.seqs.add(
            seq_id=sid,
            num_computed_tokens=0,
            num_new_tokens=CTX,
            token_ids=[(sid + i) % 128 for i in range(CTX)],
            block_ids=list(range(sid * nb, sid * nb + nb)),
            sample=True,
        )
    runner.execute(plan)
decode = epb.StepRequest(
    step_id=100,
    seqs=[epb.ScheduledSequence(seq_id=s, num_computed_tokens=CTX, num_new_tokens=1, sample=True) for s in range(32)],
)
assert CTX % 16 != 0  # decodes need no new block


def restore():
    for st in runner.seqs.values():
        st.num_computed_tokens = CTX


def bookkeeping():
    if hasattr(runner, "validate"):
        runner._apply(decode, runner.validate(decode))
    else:
        for seq_id in decode.finished_seq_ids:
            runner.seqs.pop(seq_id, None)
        runner._swap(decode)
        runner._collect(decode)


def bench(fn, n):
    times = []
    for _ in range(n):
        restore()
        t = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1000, min(times) / 1000


for _ in range(3):
    bookkeeping()
    restore()
print(f"context {CTX}: restore only      median/min us: %.1f / %.1f" % bench(lambda: None, 2000))
print(f"context {CTX}: bookkeeping       median/min us: %.1f / %.1f" % bench(bookkeeping, 5000))
if hasattr(runner, "validate"):
    print(f"context {CTX}: validate only     median/min us: %.1f / %.1f" % bench(lambda: runner.validate(decode), 5000))
print(f"context {CTX}: whole execute()   median/min us: %.1f / %.1f" % bench(lambda: runner.execute(decode), 200))
