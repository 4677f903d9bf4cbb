"""The Hugging Face `generate` baseline, measured on the same workload in the same harness.

Static batching, the way a plain `generate` server would serve the trace: requests are
taken in arrival order in batches of `batch_size`; a batch starts when its last request
has arrived and the previous batch has finished; it is left-padded, run greedily with
exactly max(output lengths of the batch) new tokens (EOS ignored), and a request's tokens
are the first `output_len` of its row. Every token's time comes from a streamer callback
that `generate` calls once per step (after the prefill for the first token), so:

    TTFT  batch start + prefill of the whole batch - arrival (the wait for the batch and
          for the previous batch counts, as queueing counts in the engine's TTFT)
    ITL   the batch's step times
    E2EL  time of the request's own last token - arrival (shorter rows are done early,
          but their slot stays busy until the longest row finishes: static batching)

The timeline is virtual: batches run back to back at full speed and their measured
durations are placed on the arrival timeline, which gives the same figures as sleeping
until each batch's start without idling the machine. Run it after any server has stopped
(the two would share the cores). torch and transformers are imported only here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from chunkserve.bench.runner import RequestRecord, RunResult, progress_bar
from chunkserve.bench.session import Run
from chunkserve.bench.workloads import BenchRequest


def _load(folder: Path, dtype: str, device: str):
    """The model as the executor would run it: `auto` = cuda if present, bf16 there, fp32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = device.startswith("cuda")
    torch_dtype = {
        "auto": torch.bfloat16 if on_cuda else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[dtype]
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()


def _batch_generate(model, batch: Sequence[BenchRequest], pad_id: int) -> list[float]:
    """Runs one static batch; returns [start, time of token 1, ..., time of token N]."""
    import copy

    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.tensor(
        [[pad_id] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in batch], device=model.device
    )
    mask = torch.tensor(
        [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch], device=model.device
    )
    new_tokens = max(r.output_len for r in batch)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample = None, False
    config.temperature = config.top_p = config.top_k = None
    clock = Clock()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            generation_config=config,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
            streamer=clock,
        )
    if out.shape[1] - width != new_tokens or len(clock.times) != new_tokens + 1:
        raise RuntimeError(
            f"HF generate made {out.shape[1] - width} tokens, {len(clock.times) - 1} steps; expected {new_tokens}"
        )
    return clock.times


def run_hf_baseline(
    folder: Path,
    dtype: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    batch_size: int,
    progress: bool = True,
    num_warmups: int = 1,
    device: str = "auto",
) -> Run:
    """The workload through HF `generate` (see the module docstring); a Run like the engine's."""
    import torch

    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
    model = _load(folder, dtype, device)
    pad_id = model.generation_config.pad_token_id or 0
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    if num_warmups:
        _batch_generate(model, [replace(r, prompt_ids=r.prompt_ids[:16], output_len=2) for r in requests[:1]], pad_id)
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    records = [
        RequestRecord(r.index, r.cls, len(r.prompt_ids), r.output_len, a, send=a) for r, a in zip(requests, arrivals)
    ]
    bar = progress_bar(len(requests), f"HF generate b={batch_size}", progress)
    clock_end = 0.0  # virtual time at which the previous batch finished
    start_wall = time.time()
    try:
        for k in range(0, len(order), batch_size):
            idx = order[k : k + batch_size]
            times = _batch_generate(model, [requests[i] for i in idx], pad_id)
            start = max(clock_end, max(arrivals[i] for i in idx))
            for i in idx:
                rec, n = records[i], requests[i].output_len
                rec.chunk_times = [start + t - times[0] for t in times[1 : n + 1]]
                rec.chunk_tokens = [1] * n
                rec.end, rec.finish_reason, rec.prompt_tokens = rec.chunk_times[-1], "LENGTH", rec.input_len
            clock_end = start + times[-1] - times[0]
            bar.update(len(idx))
    finally:
        bar.close()
    info = {
        "model_name": str(folder),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "engine": "transformers generate (static batching)",
        "batch_size": batch_size,
        "num_threads": torch.get_num_threads(),
    }
    print(f"HF baseline: {len(requests)} requests in batches of {batch_size}, {info['dtype']}", file=sys.stderr)
    return Run(RunResult(records, clock_end, start_wall), info)
