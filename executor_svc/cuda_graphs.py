"""Decode-only steps replayed from CUDA graphs, one per padded batch size (issue 17, item 4).

A decode step of a small batch on a GPU is bound by kernel launches, not arithmetic: a few
hundred small kernels, each a few microseconds to launch from Python. A CUDA graph records
the whole forward once and replays it as one launch. As vLLM does, a graph is captured at
start-up for each batch-size bucket (1, 2, 4, 8, then steps of 8 to 32 rows, 16 to 64, 32
beyond, up to --cuda-graph-max-batch), largest first, into one shared memory pool. A step of
n decodes replays the smallest bucket b >= n; rows n..b-1 are padding: a one-token sequence
whose K/V goes to a scratch block that no plan can name (the executor allocates one block
more than it reports). Prefill and mixed steps, and batches above the largest bucket, run
eagerly as before.

What a graph replays cannot depend on host values that change from step to step. Inputs and
attention metadata live in static device buffers that each step overwrites; the metadata's
host fields (`max_seqlen_k`, `query_lens`, `context_lens`) are frozen at capture. So only a
backend whose kernels read every length from the device tensors can be captured
(`AttentionBackend.graph_safe`: triton; not torch, whose CPU-minded path plans from the host
lists, nor flash_attn, whose varlen call takes max_seqlen_k as a host int).

UNTESTED ON HARDWARE IN THIS REPO (no GPU was lent when it was written). The padding, the
static buffers and the scratch block are tested on CPU, where `DecodeGraphs(capture=False)`
runs the same padded forward eagerly with the true host lengths; tests/kernels/test_gpu.py
checks capture and replay against the eager path on a GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import logging
import time

import torch

from chunkserve_kernels.forward_context import set_forward_context
from chunkserve_kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """The buckets up to max_batch: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, ..., and
    max_batch itself: a step of n rows pads to less than 2n, and to less than 1.5n above 16."""
    if max_batch < 1:
        raise ValueError(f"the largest CUDA graph batch must be >= 1, got {max_batch}")
    sizes, s = [], 1
    while s < max_batch:
        sizes.append(s)
        s = s * 2 if s < 8 else s + (8 if s < 32 else 16 if s < 64 else 32)
    return sizes + [max_batch]


class DecodeGraphs:
    """Static buffers and, on CUDA, one captured graph per bucket; `run` executes a decode step.

    `model(input_ids, positions)` must read attention from the forward context, as the
    executor's models do; `kv_cache` includes `scratch_block`, which no plan may name.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        max_model_len: int,
        scratch_block: int,
        sizes: list[int],
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.sizes = sorted(set(sizes))
        biggest = self.sizes[-1]
        self.max_blocks = -(-max_model_len // self.block_size)
        dev = kv_cache.device
        # Padding rows as they stay: token 0 at position 0, its K/V in the scratch block's
        # first slot, a context of one token read from the scratch block.
        self.input_ids = torch.zeros(biggest, dtype=torch.long, device=dev)
        self.positions = torch.zeros(biggest, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((biggest,), scratch_block * self.block_size, dtype=torch.long, device=dev)
        self.seqused_k = torch.ones(biggest, dtype=torch.int32, device=dev)
        self.block_table = torch.full((biggest, self.max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(biggest + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served from this object (graphs, or the eager padded forward)
        if capture:
            self._capture_all()

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds num_seqs decodes, or None (run the step eagerly)."""
        return next((b for b in self.sizes if b >= num_seqs), None)

    def run(self, token_ids: list[int], computed: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [n, hidden] of n decodes: token i at position computed[i], sequence
        i's block table tables[i] (covering computed[i] + 1 tokens). Writes their K/V."""
        n = len(token_ids)
        b = self.bucket(n)
        if b is None:
            raise ValueError(f"{n} decodes exceed the largest CUDA graph batch {self.sizes[-1]}")
        width = self._fill(token_ids, computed, tables, b)
        self.replays += 1
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            return self.outputs[b][:n]
        meta = self._meta(b, [c + 1 for c in computed] + [1] * (b - n), width)
        with set_forward_context(meta, self.kv_cache):
            return self.model(self.input_ids[:b], self.positions[:b])[:n]

    def _fill(self, token_ids: list[int], computed: list[int], tables: list[list[int]], b: int) -> int:
        """Writes the step into the static buffers' first b rows: five tensors built from
        Python lists, one host->device copy each (from pinned memory, asynchronous; torch's
        pinned allocator keeps a buffer until its copy is done). Returns the block-table
        columns written; columns past them keep earlier steps' ids, which nothing reads: a
        sequence's keys stop at its seqused_k."""
        n, bs, scratch = len(token_ids), self.block_size, self.scratch_block
        width = max(len(t) for t in tables)
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds max_model_len {self.max_model_len}")
        pad = b - n
        rows = [t + [scratch] * (width - len(t)) for t in tables] + [[scratch] * width] * pad
        slots = [t[c // bs] * bs + c % bs for t, c in zip(tables, computed)] + [scratch * bs] * pad
        cuda = self.kv_cache.device.type == "cuda"
        for dst, values, dtype in (
            (self.input_ids[:b], token_ids + [0] * pad, torch.long),
            (self.positions[:b], computed + [0] * pad, torch.long),
            (self.slot_mapping[:b], slots, torch.long),
            (self.seqused_k[:b], [c + 1 for c in computed] + [1] * pad, torch.int32),
            (self.block_table[:b, :width], rows, torch.int32),
        ):
            src = torch.tensor(values, dtype=dtype)
            dst.copy_(src.pin_memory() if cuda else src, non_blocking=cuda)
        return width

    def _meta(self, b: int, context_lens: list[int], width: int | None = None) -> AttentionMetadata:
        """Metadata over the static buffers' first b rows. The host fields are the step's own
        in the eager (CPU) path; a captured graph keeps those of its capture, which is why
        only graph-safe backends are captured."""
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            seqused_k=self.seqused_k[:b],
            block_table=self.block_table[:b, : width or self.max_blocks],
            slot_mapping=self.slot_mapping[:b],
            max_seqlen_q=1,
            max_seqlen_k=max(context_lens),
            block_size=self.block_size,
            query_lens=[1] * b,
            context_lens=context_lens,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Captures every bucket, largest first, into one memory pool. The buffers hold
        padding rows only while capturing, so the warm-up forwards write the scratch block alone."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.kv_cache.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            meta = self._meta(b, [self.max_model_len] * b)  # host lengths a graph-safe kernel ignores
            side = torch.cuda.Stream(self.kv_cache.device)
            side.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
            with torch.cuda.stream(side):  # warm-up: lazy initialisation, Triton compilation
                for _ in range(2):
                    with set_forward_context(meta, self.kv_cache):
                        self.model(self.input_ids[:b], self.positions[:b])
            torch.cuda.current_stream(self.kv_cache.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), set_forward_context(meta, self.kv_cache):
                self.outputs[b] = self.model(self.input_ids[:b], self.positions[:b])
            self.graphs[b] = graph
        torch.cuda.synchronize(self.kv_cache.device)
        used = free_before - torch.cuda.mem_get_info(self.kv_cache.device)[0]
        log.info(
            "CUDA graphs captured for decode batches %s in %.1f s (%.0f MiB)",
            self.sizes,
            time.perf_counter() - start,
            used / 2**20,
        )
