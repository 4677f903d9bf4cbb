"""The executor's start-up, in named phases (server.py serves what `load` returns):

    place = init_device(config, tp)                threads, tensor-parallel group, device, dtypes, backend
    model, hf, path = load_weights(config, place, tp)
    make_reduced_copies(model, config, place)                int4 / 16-bit copies of the linears
    native = load_native_kernels(model, config, place)       our own ops: C++ on a CPU, Triton norms on a GPU
    plan_linears(model, config, place, native, tp)           which kernel each step size uses
    use_fused_decode(model, native)                          small decode steps as one native call
    kv = allocate_kv_cache(config, hf, place, tp)            device and host blocks
    -> Loaded(runner, handshake)

Each phase takes what the ones before it returned and says in the log what it chose. The
order matters where a phase reads what an earlier one made: the plan times the copies made
before it, and the fused layers take the plan and the int4 copies.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chunkserve_contracts import __version__
from chunkserve_contracts.cpu import cpu_budget
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_kernels import cpu_native
from chunkserve_kernels.backend import AttentionBackend, choose_backend, get_backend
from executor_svc import memory
from executor_svc.collectives import NO_TP, PlanChannel, TPInfo, init_group, local_device, min_over_group
from executor_svc.config import ExecutorConfig
from executor_svc.cuda_graphs import DecodeGraphs, capture_sizes
from executor_svc.model_loader import load_model, resolve_model
from executor_svc.models import linear_plan
from executor_svc.models.kernel_plan import Plan, table_plan
from executor_svc.models.layers import prepack_measured
from executor_svc.models.quant import default_rules, half_weights_model, quantize_model
from executor_svc.runner import Emit, ModelRunner
from executor_svc.threads import ThreadGovernor, choose_counts
from executor_svc.tp_group import CMD_RESET, Leader

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Placement:
    """Where and in what the model computes (`init_device`)."""

    device: torch.device
    dtype: torch.dtype  # activations and KV cache
    half: str | None  # --dtype bfloat16/float16 on CPU: float32 math plus 16-bit copies of this dtype
    reduced: str | None  # the reduced-precision copies' mode: "int4", `half`, or None
    backend: AttentionBackend
    threads: tuple[int, ...] = (1,)  # torch thread counts, most first (one: fixed; executor_svc/threads.py)


@dataclass(frozen=True, slots=True)
class KVCache:
    """The paged KV cache (`allocate_kv_cache`): [layers, 2, blocks, block_size, kv_heads, head_dim]."""

    device: torch.Tensor
    host: torch.Tensor | None  # swap space, same shape with the host blocks
    num_device_blocks: int  # what plans may name (a CUDA graphs scratch block is not counted)
    num_host_blocks: int
    bytes_per_block: int
    graphs: bool  # decode steps replay CUDA graphs


@dataclass
class Loaded:
    runner: ModelRunner
    handshake: epb.HandshakeResponse
    leader: Leader | None = None  # rank 0 of a tensor-parallel group: sends every command to the others

    def step(self, request: epb.StepRequest, emit: Emit | None = None) -> epb.StepResponse:
        """Runs one plan (on the compute thread; every rank of a group runs it); `emit`: see execute."""
        if self.leader is None:
            return self.runner.execute(request, emit)
        return self.leader.run(self.runner.execute, request, emit, payload=request.SerializeToString())

    def reset(self) -> None:
        if self.leader is None:
            return self.runner.reset()
        return self.leader.run(self.runner.reset, cmd=CMD_RESET)


def load(config: ExecutorConfig, tp: TPInfo = NO_TP) -> Loaded:
    """Loads the model and allocates the KV cache; raises ValueError on a setting that cannot work.

    With `tp` (a tensor-parallel rank, executor_svc/tp_group.py) it joins the group first,
    loads this rank's shard, and sizes the KV cache to what every rank can hold."""
    place = init_device(config, tp)
    model, hf, path = load_weights(config, place, tp)
    make_reduced_copies(model, config, place)
    native = load_native_kernels(model, config, place)
    plan_linears(model, config, place, native, tp)
    use_fused_decode(model, native)
    kv = allocate_kv_cache(config, hf, place, tp)
    channel = PlanChannel(place.device) if tp.enabled else None
    runner = ModelRunner(
        model,
        kv.device,
        kv.host,
        hf.vocab_size,
        config.max_num_batched_tokens,
        model.max_model_len,
        tp,
        channel,
        reserved_blocks=int(kv.graphs),
        threads=ThreadGovernor(place.threads, torch.set_num_threads) if len(place.threads) > 1 else None,
    )
    if kv.graphs:
        capture_cuda_graphs(runner, config, kv)
    return Loaded(runner, handshake(config, hf, path, place, kv, tp, model.max_model_len))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on CUDA; float32 on CPU, where without AVX512-BF16/AMX bf16 matmuls are
    emulated and a batch-32 decode step measured 3.4x slower than in float32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def init_device(config: ExecutorConfig, tp: TPInfo) -> Placement:
    """Threads, the tensor-parallel group, the device, the dtypes and the attention backend."""
    threads, why = choose_counts(config.num_threads, tp.size, cpu_budget())
    torch.set_num_threads(threads[0])
    log.info("%d torch CPU threads (%s; --num-threads overrides)", threads[0], why)
    device = resolve_device(config.device)
    if tp.enabled:
        init_group(tp, device, config.tensor_parallel_timeout_s)
        device = local_device(device)
    dtype = resolve_dtype(config.dtype, device)
    # On CPU a 16-bit --dtype is float32 math plus 16-bit weight copies (models/quant.HalfWeights).
    half = config.dtype if device.type == "cpu" and dtype != torch.float32 else None
    if half:
        dtype = torch.float32
        if tp.enabled:
            raise ValueError(
                f"--dtype {config.dtype} on CPU is not supported with --tensor-parallel-size {tp.size}: "
                "use --dtype float32"
            )
    name = config.attention_backend
    backend = get_backend(choose_backend(device, dtype, config.block_size) if name == "auto" else name)
    backend.check_dtype(dtype)
    backend.check_block_size(config.block_size)
    reduced = config.quantization if config.quantization != "none" else half
    return Placement(device, dtype, half, reduced, backend, threads if device.type == "cpu" else threads[:1])


def load_weights(config: ExecutorConfig, place: Placement, tp: TPInfo) -> tuple[Any, Any, Path]:
    """The model (this rank's shard) with its checkpoint weights, its HF config and its folder."""
    path = resolve_model(config.model, Path(config.cache_dir))
    model, hf = load_model(path, place.dtype, place.device, place.backend.name, tp)
    return model, hf, path


def make_reduced_copies(model: Any, config: ExecutorConfig, place: Placement) -> None:
    """--quantization int4 or a CPU 16-bit --dtype: the reduced-precision copies of the
    linears (which steps use them is the plan's choice)."""
    if config.quantization != "none":
        if place.device.type != "cpu" or place.dtype != torch.float32 or place.half:
            raise ValueError("--quantization int4 is a CPU mode over float32 weights: use --device cpu --dtype float32")
        s = quantize_model(model, config.quantization)
        log.info(
            "int4 copies of %d linear layers and a bfloat16 head; %d of %d groups of 32 hold their float32 "
            "weights exactly before the bf16 rounding of scale and zero",
            *(s["layers"], s["exact_groups"], s["groups"]),
        )
    elif place.half:
        s = half_weights_model(model, place.half)
        log.info(
            "--dtype %s on CPU: %s copies of %d linear weights and the head (+%.0f MB); float32 weights, KV "
            "cache and activations beside them",
            *(place.half, place.half, s["layers"], s["bytes"] / 1e6),
        )


def load_native_kernels(model: Any, config: ExecutorConfig, place: Placement) -> bool:
    """--cpu-kernels: float32 decode attention, K/V writes and residual add + RMSNorm on the
    native CPU ops (chunkserve_kernels/cpu_native.py) where they apply and load; returns
    whether they did. `native` that cannot apply or load refuses to start. On a GPU a 16-bit
    model's residual add + RMSNorm is one Triton kernel instead (chunkserve_kernels/triton_norm.py)."""
    if place.device.type == "cuda" and place.dtype != torch.float32:
        on = model.use_triton_norms()
        log.info("residual add + RMSNorm: %s", "one Triton kernel" if on else "torch's ops (triton does not import)")
    choice = config.cpu_kernels
    applies = place.device.type == "cpu" and place.backend.name == "torch" and place.dtype == torch.float32
    if choice == "torch":
        return False
    if not applies:
        if choice == "native":
            raise ValueError(
                "--cpu-kernels native needs --device cpu, --attention-backend torch and float32 activations "
                f"(this executor: {place.device.type}, {place.backend.name}, {place.dtype})"
            )
        return False
    why = cpu_native.load()
    if why is not None:
        if choice == "native":
            raise ValueError(f"--cpu-kernels native: the native kernels did not build or load: {why}")
        log.warning("native CPU kernels unavailable (%s): attention and norms run on aten ops", why)
        return False
    model.use_native_kernels()
    log.info("float32 decode attention, K/V writes and add + RMSNorm: native CPU kernels (--cpu-kernels %s)", choice)
    return True


def plan_linears(model: Any, config: ExecutorConfig, place: Placement, native: bool, tp: TPInfo) -> None:
    """Which kernel each linear uses per step size (models/kernel_plan.py): measured on this
    machine (--cpu-linear-plan measure / remeasure, float32 CPU, no tensor parallelism) or
    built from the tables (also when a measurement was disturbed by other work on the CPU);
    either way one Plan per part, set by `model.use_plan`."""
    cpu_fp32 = place.device.type == "cpu" and place.dtype == torch.float32
    measured = config.cpu_linear_plan != "table" and cpu_fp32 and not tp.enabled
    if config.cpu_linear_plan != "table" and cpu_fp32 and tp.enabled:
        log.info("--cpu-linear-plan measure: not under tensor parallelism (the ranks would need one plan); table")
    plans, source = None, "from the tables (--cpu-linear-plan table)"
    if measured:
        if config.cpu_gemm_prepack:  # timed per step size, dropped where no size chose them
            model.prepack()
        plans, source = linear_plan.kept_or_measured(
            model,
            Path(config.cache_dir) / "linear-plans",
            remeasure=config.cpu_linear_plan == "remeasure",
            reduced=place.reduced,
            reduced_max_rows=config.quantized_max_rows,
            padding=config.cpu_gemm_row_padding,
            gemv=native,
            budget=config.max_num_batched_tokens,
        )
    body, head = plans or table_plans(model, config, place)
    freed = model.use_plan(body, head)
    kept = sum(lin.weight.nbytes for lin in [*model.decoder_linears(), model.lm_head] if lin.packed is not None)
    log.info(
        "CPU linear plan %s (step tokens: kernel): linears %s; head %s; packed float32 copies kept: +%.0f MB "
        "(%.0f MB not chosen, dropped)",
        *(source, body, head, kept / 1e6, freed / 1e6),
    )


def table_plans(model: Any, config: ExecutorConfig, place: Placement) -> tuple[Plan, Plan]:
    """The (linears, head) plans the per-CPU-class tables give: row padding per
    --cpu-gemm-row-padding, oneDNN's packed copies from 3 rows on AVX512 CPUs, the reduced
    mode's row rule (models/quant.ROW_RULES, or --quantized-max-rows)."""
    rows, head_rows = default_rules(place.reduced, config.quantized_max_rows) if place.reduced else (None, None)
    # Not where a reduced copy serves every large step (bfloat16 on a native-bf16 CPU): the
    # packed copy would serve only 3-4 token steps there, for float32's memory once more.
    cpu_fp32 = place.device.type == "cpu" and place.dtype == torch.float32
    pack = config.cpu_gemm_prepack and cpu_fp32 and prepack_measured() and not (rows and rows.max_rows is None)
    if pack and model.lm_head.packed is None:
        model.prepack()
    upto, pad = config.max_num_batched_tokens, config.cpu_gemm_row_padding and cpu_fp32  # MKL's remedy: not GPUs'
    body = table_plan(rows, packed=pack, padding=pad, upto=upto)
    return body, table_plan(head_rows, packed=pack, padding=pad, upto=upto)


def use_fused_decode(model: Any, native: bool) -> bool:
    """With the native kernels on, pure-decode steps whose linears the plan gives to the native
    product, the packed copies or the int4 copies run every decoder layer as one native call
    (models/fused.py); not under tensor parallelism (no collectives there)."""
    if not native or model.tp.enabled:
        return False
    model.use_fused_decode()
    kernels = ", ".join(sorted(model.fused.kernels))
    log.info("pure-decode steps whose linears take one of %s: one native call for all layers", kernels)
    return True


def kv_block_counts(config: ExecutorConfig, bytes_per_block: int, device: torch.device) -> tuple[int, int]:
    """Device and host block counts from the memory flags (after the weights are loaded)."""
    if config.num_gpu_blocks_override is not None:
        device_blocks = config.num_gpu_blocks_override
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        available = free - (1 - config.gpu_memory_utilization) * total
        device_blocks = int(available // bytes_per_block)
    else:
        device_blocks = int(config.kv_cache_memory_gib * 2**30 // bytes_per_block)
    if device_blocks < 1:
        raise ValueError(
            f"no memory left for even one KV block ({bytes_per_block} bytes): raise "
            "--kv-cache-memory-gib / --gpu-memory-utilization"
        )
    return device_blocks, int(config.swap_space * 2**30 // bytes_per_block)


def use_cuda_graphs(config: ExecutorConfig, device: torch.device, backend: AttentionBackend, tp: TPInfo) -> bool:
    """Whether decode steps replay CUDA graphs (--cuda-graphs, on CUDA only); says why not."""
    if not config.cuda_graphs or device.type != "cuda":
        return False
    why = "not under tensor parallelism (its collectives are not captured)" if tp.enabled else None
    if not backend.graph_safe:
        why = f"attention backend {backend.name!r} is not graph-safe (use --attention-backend triton)"
    if why is not None:
        log.info("CUDA graphs off: %s", why)
    return why is None


def allocate_kv_cache(config: ExecutorConfig, hf: Any, place: Placement, tp: TPInfo) -> KVCache:
    """The device and host KV tensors, sized by the memory flags (every rank of a group to
    what all of them can hold: a block id must be valid on every rank)."""
    # Each rank holds its num_kv_heads / tp.size heads of every block.
    shape = (hf.num_hidden_layers, 2, 1, config.block_size, _kv_heads(hf) // tp.size, _head_dim(hf))
    bytes_per_block = torch.empty(shape, dtype=place.dtype, device="meta").numel() * place.dtype.itemsize
    device_blocks, host_blocks = kv_block_counts(config, bytes_per_block, place.device)
    if tp.enabled:
        device_blocks, host_blocks = min_over_group([device_blocks, host_blocks], place.device)
    graphs = use_cuda_graphs(config, place.device, place.backend, tp)
    # With CUDA graphs one more block than reported: the padding rows' scratch block.
    dev = memory.zeros(shape[:2] + (device_blocks + graphs,) + shape[3:], place.dtype, place.device)  # huge pages
    host_shape, pinned = shape[:2] + (host_blocks,) + shape[3:], place.device.type == "cuda"
    host = torch.empty(host_shape, dtype=place.dtype, pin_memory=pinned) if host_blocks else None
    return KVCache(dev, host, device_blocks, host_blocks, bytes_per_block, graphs)


def capture_cuda_graphs(runner: ModelRunner, config: ExecutorConfig, kv: KVCache) -> None:
    sizes = capture_sizes(min(config.cuda_graph_max_batch, config.max_num_batched_tokens))
    try:
        runner.graphs = DecodeGraphs(
            runner.model, kv.device, runner.model.max_model_len, kv.num_device_blocks, sizes, capture=True
        )
    except Exception as exc:  # noqa: BLE001 - never yet run on hardware: serve eagerly rather than not at all
        log.warning("CUDA graphs off: capture failed (%r); every step runs eagerly", exc)
        torch.cuda.synchronize(kv.device.device)
        torch.cuda.empty_cache()


def _head_dim(hf: Any) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _kv_heads(hf: Any) -> int:
    return getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads


def eos_token_ids(model_path: Path, hf_config: object) -> list[int]:
    """EOS ids from the model config and generation_config.json (either may hold a list)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen = model_path / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return sorted(ids)


def handshake(
    config: ExecutorConfig, hf: Any, path: Path, place: Placement, kv: KVCache, tp: TPInfo, max_model_len: int
) -> epb.HandshakeResponse:
    """What the executor tells its scheduler once: the model, its limits and the pool sizes."""
    name = "SmolLM2-135M-Instruct" if config.model in ("default", "") else config.model
    response = epb.HandshakeResponse(
        model=epb.ModelConfig(
            architecture=(hf.architectures or ["?"])[0],
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            num_kv_heads=_kv_heads(hf),
            head_dim=_head_dim(hf),
            vocab_size=hf.vocab_size,
            max_position_embeddings=max_model_len,
            eos_token_ids=eos_token_ids(path, hf),
        ),
        model_name=name,
        model_path=str(path),
        dtype=str(place.dtype).removeprefix("torch.") + (f"+{place.reduced}" if place.reduced else ""),
        device=place.device.type,
        block_size=config.block_size,
        num_device_blocks=kv.num_device_blocks,
        num_host_blocks=kv.num_host_blocks,
        attention_backend=place.backend.name,
        max_num_batched_tokens=config.max_num_batched_tokens,
        version=__version__,
        tensor_parallel_size=tp.size,
    )
    log.info(
        "%sloaded %s from %s: %s on %s, %d KV blocks x %d tokens (%.2f GiB), %d host blocks",
        *(f"rank {tp.rank} of {tp.size}: " if tp.enabled else "", name, path, response.dtype, place.device),
        *(kv.num_device_blocks, config.block_size, kv.num_device_blocks * kv.bytes_per_block / 2**30),
        kv.num_host_blocks,
    )
    return response
