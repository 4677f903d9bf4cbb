"""The executor process: load the model, size the KV cache, serve chunkserve.executor.v1.

A plain threaded gRPC server: steps arrive one at a time from the one scheduler, and every
torch call runs on one compute thread (see ExecutorServicer), which serialises them even if
a second caller appears. Torch work blocks the handling thread, not the server, so health
and handshake calls still answer during a long step. With an
executor token (always, under `chunkserve serve`) only the scheduler that holds it gets past
the interceptor: no second scheduler drives this KV cache.

With --tensor-parallel-size N > 1 this process is rank 0 of a group (executor_svc/parallel.py):
it forwards every step and reset to ranks 1..N-1 before running it on its own shard.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from chunkserve_kernels import cpu_native
from chunkserve_kernels.backend import AttentionBackend, choose_backend, get_backend
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkserve_contracts import __version__
from chunkserve_contracts.auth import SyncBearerTokenInterceptor
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc
from chunkserve_contracts.flags import config_to_argv
from chunkserve_contracts.ownership import port_in_use
from executor_svc.config import ExecutorConfig
from executor_svc.cuda_graphs import DecodeGraphs, capture_sizes
from executor_svc.model_loader import load_model, resolve_model
from executor_svc.models import linear_plan
from executor_svc.models.layers import (
    PREPACK_MIN_ROWS,
    PagedAttention,
    RMSNorm,
    prepack_measured,
    set_cpu_gemm_row_padding,
)
from executor_svc.models.llama import LlamaModel, prepack_model
from executor_svc.models.quant import default_rules, half_weights_model, native_bf16, quantize_model
from executor_svc.parallel import (
    CMD_RESET,
    EXIT_GROUP_LOST,
    NO_TP,
    Leader,
    LocalGroup,
    PlanChannel,
    TPInfo,
    check_divisible,
    end_group,
    env_rank,
    ignore_interrupts,
    init_group,
    local_device,
    min_over_group,
    spawn_local_ranks,
    worker_loop,
)
from executor_svc.runner import ModelRunner, PlanError

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVICE_NAME = epb.DESCRIPTOR.services_by_name["Executor"].full_name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKEN_DENIAL = (
    "missing or wrong executor token: this executor belongs to another scheduler (each "
    "`chunkserve serve` has its own), or CHUNKSERVE_EXECUTOR_TOKEN differs between the services"
)


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


@dataclass
class Loaded:
    runner: ModelRunner
    handshake: epb.HandshakeResponse
    leader: Leader | None = None  # rank 0 of a tensor-parallel group: sends every command to the others

    def step(self, request: epb.StepRequest) -> epb.StepResponse:
        """Runs one plan (on the compute thread); in a group every rank runs it."""
        if self.leader is None:
            return self.runner.execute(request)
        return self.leader.run(self.runner.execute, request, payload=request.SerializeToString())

    def reset(self) -> None:
        if self.leader is None:
            return self.runner.reset()
        return self.leader.run(self.runner.reset, cmd=CMD_RESET)


def use_cuda_graphs(config: ExecutorConfig, device: torch.device, backend: AttentionBackend, tp: TPInfo) -> bool:
    """Whether decode steps replay CUDA graphs (--cuda-graphs, on CUDA only); says why not."""
    if not config.cuda_graphs or device.type != "cuda":
        return False
    if not backend.graph_safe:
        log.info(
            "CUDA graphs off: attention backend %r is not graph-safe (use --attention-backend triton)", backend.name
        )
        return False
    if tp.enabled:
        log.info("CUDA graphs off: not under tensor parallelism (its collectives are not captured)")
        return False
    return True


def setup_cpu_kernels(
    model: torch.nn.Module, choice: str, backend_name: str, device: torch.device, dtype: torch.dtype
) -> bool:
    """--cpu-kernels: switches the model's torch attention backend (decode attention, K/V
    writes) and its RMSNorms (residual add + norm) to the native float32 ops
    (chunkserve_kernels/cpu_native.py) where they apply and load; returns whether it did.
    `native` that cannot apply or load is a ValueError (the executor refuses to start)."""
    applies = device.type == "cpu" and backend_name == "torch" and dtype == torch.float32
    if choice == "torch":
        return False
    if not applies:
        if choice == "native":
            raise ValueError(
                "--cpu-kernels native needs --device cpu, --attention-backend torch and float32 "
                f"activations (this executor: {device.type}, {backend_name}, {dtype})"
            )
        return False
    why = cpu_native.load()
    if why is not None:
        if choice == "native":
            raise ValueError(f"--cpu-kernels native: the native kernels did not build or load: {why}")
        log.warning("native CPU kernels unavailable (%s): attention and norms run on aten ops", why)
        return False
    backends = {id(m.backend): m.backend for m in model.modules() if isinstance(m, PagedAttention)}
    for backend in backends.values():
        backend.use_native()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.native = True
    log.info("float32 decode attention, K/V writes and add + RMSNorm: native CPU kernels (--cpu-kernels %s)", choice)
    return True


def setup_fused_decode(model: torch.nn.Module, native: bool) -> bool:
    """With the native kernels on (`setup_cpu_kernels`), small pure-decode steps whose linears
    the plan gives to the native product or the int4 copies run each decoder layer as one
    native op (models/llama.py `LlamaModel.use_fused_decode`); after the copies are made."""
    inner = getattr(model, "model", None)
    if not native or not isinstance(inner, LlamaModel) or inner.tp.enabled:
        return False
    inner.use_fused_decode()
    log.info("decode steps whose linears take the native product or int4 copies: one native op per decoder layer")
    return True


def load(config: ExecutorConfig, tp: TPInfo = NO_TP) -> Loaded:
    """Loads the model and allocates the KV cache; raises ValueError on a setting that cannot work.

    With `tp` (a tensor-parallel rank, executor_svc/parallel.py) it joins the group first,
    loads this rank's shard, and sizes the KV cache to what every rank can hold."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    set_cpu_gemm_row_padding(config.cpu_gemm_row_padding)
    device = resolve_device(config.device)
    if tp.enabled:
        init_group(tp, device, config.tensor_parallel_timeout_s)
        device = local_device(device)
    dtype = resolve_dtype(config.dtype, device)
    # On CPU a 16-bit --dtype is float32 math plus 16-bit weight copies for small steps
    # (models/quant.HalfWeights: torch's 16-bit GEMM without AVX512-BF16 wins only there).
    half = config.dtype if device.type == "cpu" and dtype != torch.float32 else None
    if half:
        dtype = torch.float32
        if tp.enabled:
            raise ValueError(
                f"--dtype {config.dtype} on CPU is not supported with --tensor-parallel-size {tp.size}: "
                "use --dtype float32"
            )
    reduced = config.quantization if config.quantization != "none" else half
    # which steps take the reduced copies: a measured table per CPU class, or --quantized-max-rows
    rows, head_rows = default_rules(reduced, config.quantized_max_rows) if reduced else (None, None)
    backend_name = (
        choose_backend(device, dtype, config.block_size)
        if config.attention_backend == "auto"
        else config.attention_backend
    )
    backend = get_backend(backend_name)
    backend.check_dtype(dtype)
    backend.check_block_size(config.block_size)
    path = resolve_model(config.model, Path(config.cache_dir))
    model, hf = load_model(path, dtype, device, backend_name, tp)
    native = setup_cpu_kernels(model, config.cpu_kernels, backend_name, device, dtype)
    if config.quantization != "none":
        if device.type != "cpu" or dtype != torch.float32 or half:
            raise ValueError("--quantization int4 is a CPU mode over float32 weights: use --device cpu --dtype float32")
        stats = quantize_model(model, config.quantization, rows, head_rows)
        log.info(
            "int4 weights for %d linear layers (steps of %s), a bfloat16 head (steps of %s; native bfloat16: %s); "
            "%d of %d groups of 32 hold their float32 weights exactly before the bf16 rounding of scale and zero",
            stats["layers"],
            rows,
            head_rows,
            native_bf16(),
            stats["exact_groups"],
            stats["groups"],
        )
    elif half:
        stats = half_weights_model(model, half, rows, head_rows)
        log.info(
            "--dtype %s on CPU: %s copies of %d linear weights and the head (+%.0f MB) for steps of %s "
            "(native bfloat16: %s); float32 weights for other steps, float32 KV cache and activations",
            half,
            half,
            stats["layers"],
            stats["bytes"] / 1e6,
            rows,
            native_bf16(),
        )
    # A measured plan (models/linear_plan) times every kernel the loaded copies allow, so it
    # gets the packed copies wherever oneDNN is (and drops them if no step size chose them).
    measure_plan = config.cpu_linear_plan != "table" and device.type == "cpu" and dtype == torch.float32
    if measure_plan and tp.enabled:
        log.info("--cpu-linear-plan measure: not under tensor parallelism (the ranks would need one plan); table")
        measure_plan = False
    # Not where a reduced copy serves every large step (bfloat16 on a native-bf16 CPU): the
    # packed copy would serve only 3-4 token steps there, for float32's memory once more.
    reduced_covers_large = rows is not None and rows.max_rows is None
    if measure_plan:
        if config.cpu_gemm_prepack:
            prepack_model(model)
        plans, source = linear_plan.kept_or_measured(
            model,
            Path(config.cache_dir) / "linear-plans",
            remeasure=config.cpu_linear_plan == "remeasure",
            reduced=reduced,
            reduced_max_rows=config.quantized_max_rows,
            padding=config.cpu_gemm_row_padding,
            gemv=native,
        )
        freed = linear_plan.apply(model, *plans)
        packed_bytes = sum(lin.weight.nbytes for lin in linear_plan.decoder_linears(model) if lin.packed is not None)
        log.info(
            "CPU linear plan %s (step tokens: kernel): linears %s; head %s; packed float32 "
            "copies kept: +%.0f MB (%.0f MB not chosen, dropped)",
            source,
            plans[0],
            plans[1],
            packed_bytes / 1e6,
            freed / 1e6,
        )
    elif config.cpu_gemm_prepack and device.type == "cpu" and dtype == torch.float32 and not reduced_covers_large:
        if prepack_measured():
            added = prepack_model(model)
            log.info(
                "float32 linears: oneDNN packed copies for steps of >= %d tokens (+%.0f MB)",
                PREPACK_MIN_ROWS,
                added / 1e6,
            )
        else:
            log.info(
                "--cpu-gemm-prepack: not applied, measured faster on AVX512 CPUs only (this one: %s)",
                torch.backends.cpu.get_cpu_capability(),
            )
    setup_fused_decode(model, native)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    # Each rank holds its num_kv_heads / tp.size heads of every block.
    shape_per_block = (hf.num_hidden_layers, 2, 1, config.block_size, num_kv_heads // tp.size, head_dim)
    bytes_per_block = torch.empty(shape_per_block, dtype=dtype, device="meta").numel() * dtype.itemsize
    device_blocks, host_blocks = kv_block_counts(config, bytes_per_block, device)
    if tp.enabled:  # the block ids the scheduler hands out must be valid on every rank
        device_blocks, host_blocks = min_over_group([device_blocks, host_blocks], device)
    graphs = use_cuda_graphs(config, device, backend, tp)
    # With CUDA graphs one more block than reported: the padding rows' scratch block.
    kv_cache = torch.zeros(
        shape_per_block[:2] + (device_blocks + graphs,) + shape_per_block[3:], dtype=dtype, device=device
    )
    host_cache = None
    if host_blocks:
        host_cache = torch.empty(
            shape_per_block[:2] + (host_blocks,) + shape_per_block[3:], dtype=dtype, pin_memory=device.type == "cuda"
        )
    channel = PlanChannel(device) if tp.enabled else None
    runner = ModelRunner(
        model,
        kv_cache,
        host_cache,
        hf.vocab_size,
        config.max_num_batched_tokens,
        model.max_model_len,
        tp,
        channel,
        reserved_blocks=int(graphs),
    )
    if graphs:
        sizes = capture_sizes(min(config.cuda_graph_max_batch, config.max_num_batched_tokens))
        try:
            runner.graphs = DecodeGraphs(model, kv_cache, model.max_model_len, device_blocks, sizes, capture=True)
        except Exception as exc:  # noqa: BLE001 - never yet run on hardware: serve eagerly rather than not at all
            log.warning("CUDA graphs off: capture failed (%r); every step runs eagerly", exc)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    name = "SmolLM2-135M-Instruct" if config.model in ("default", "") else config.model
    handshake = epb.HandshakeResponse(
        model=epb.ModelConfig(
            architecture=(hf.architectures or ["?"])[0],
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            max_position_embeddings=model.max_model_len,
            eos_token_ids=eos_token_ids(path, hf),
        ),
        model_name=name,
        model_path=str(path),
        dtype=str(dtype).removeprefix("torch.") + (f"+{reduced}" if reduced else ""),
        device=device.type,
        block_size=config.block_size,
        num_device_blocks=device_blocks,
        num_host_blocks=host_blocks,
        attention_backend=backend_name,
        max_num_batched_tokens=config.max_num_batched_tokens,
        version=__version__,
        tensor_parallel_size=tp.size,
    )
    log.info(
        "%sloaded %s from %s: %s on %s, %d KV blocks x %d tokens (%.2f GiB), %d host blocks",
        f"rank {tp.rank} of {tp.size}: " if tp.enabled else "",
        name,
        path,
        handshake.dtype,
        device,
        device_blocks,
        config.block_size,
        device_blocks * bytes_per_block / 2**30,
        host_blocks,
    )
    return Loaded(runner, handshake)


class ExecutorServicer(epb_grpc.ExecutorServicer):
    """Thin: converts errors to status codes; the runner does the work.

    Every torch call, loading included, runs on the one compute thread it is given. Each
    thread that calls into torch gets its own OpenMP team, and a second team steals the
    cores from the busy one: measured here, a batch-8 decode step took 289 ms on a thread
    other than the one that loaded the model, 123 ms on the same one. One thread also
    serialises the steps.
    """

    def __init__(self, loaded: Loaded, compute: futures.ThreadPoolExecutor) -> None:
        self._loaded = loaded
        self._compute = compute
        # Async scheduling sends step N+1 while N runs, on another gRPC thread: it is queued on
        # the compute thread (first in, first out) only once N is, as follows_step_id says.
        self._order = threading.Condition()
        self._last_queued: int | None = None  # step id last queued since start or Reset

    def Handshake(self, request: epb.HandshakeRequest, context: grpc.ServicerContext) -> epb.HandshakeResponse:
        log.debug("handshake from %s", request.scheduler_version or "a probe")
        return self._loaded.handshake

    def Step(self, request: epb.StepRequest, context: grpc.ServicerContext) -> epb.StepResponse:
        with self._order:
            if request.HasField("follows_step_id"):
                follows = request.follows_step_id
                context.add_callback(self._notify)  # a cancelled call stops waiting at once
                if (
                    not self._order.wait_for(
                        lambda: self._last_queued == follows or not context.is_active(),
                        timeout=context.time_remaining(),
                    )
                    or not context.is_active()
                ):
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"step {request.step_id} follows step {follows}, which never arrived",
                    )
            step = self._compute.submit(self._loaded.step, request)
            self._last_queued = request.step_id
            self._order.notify_all()
        try:
            return step.result()
        except PlanError as exc:
            log.error("rejected plan: %s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except torch.OutOfMemoryError as exc:
            log.error("out of memory in step %d: %s", request.step_id, exc)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory in step {request.step_id}")
        raise AssertionError("unreachable: abort raises")

    def _notify(self) -> None:
        with self._order:  # reentrant: gRPC may call this on the thread that holds it
            self._order.notify_all()

    def Reset(self, request: epb.ResetRequest, context: grpc.ServicerContext) -> epb.ResetResponse:
        with self._order:
            self._last_queued = None  # a new scheduler numbers its steps from 0 again
            reset = self._compute.submit(self._loaded.reset)
        reset.result()
        return epb.ResetResponse()


def serve(config: ExecutorConfig, stop: threading.Event | None = None) -> None:
    """Loads, listens, and serves until stop is set. With config.executor_token every
    executor call must carry it (UNAUTHENTICATED otherwise); health stays open."""
    stop = stop or threading.Event()
    tp, group = join_group(config)
    if tp.rank > 0:  # a tensor-parallel rank other than 0: no gRPC, it runs what rank 0 sends
        ignore_interrupts()
        loaded = load(config, tp)
        try:
            worker_loop(loaded.runner, loaded.runner.channel)
        except Exception as exc:  # noqa: BLE001 - rank 0 or another rank is gone: so is the group
            log.error("rank %d of %d: the tensor-parallel group ended: %r", tp.rank, tp.size, exc)
            logging.shutdown()
            os._exit(EXIT_GROUP_LOST)
        return
    compute = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    try:
        loaded = compute.submit(load, config, tp).result()
    except BaseException:
        if group is not None:
            group.stop()
        raise
    if tp.enabled:
        loaded.leader = Leader(loaded.runner.channel, group, config.tensor_parallel_timeout_s)
        loaded.leader.keepalive(compute, stop)
    try:
        if not stop.is_set():  # told to stop (or the parent died) while loading: never listen
            _listen(config, loaded, compute, stop)
    finally:
        if loaded.leader is not None:
            compute.submit(loaded.leader.close).result()
        compute.shutdown()


def join_group(config: ExecutorConfig) -> tuple[TPInfo, LocalGroup | None]:
    """This process's tensor-parallel rank, and the local ranks it started (rank 0 started
    plainly with --tensor-parallel-size N > 1 starts ranks 1..N-1; under torchrun, the
    environment says the rank and nobody starts anything)."""
    size = config.tensor_parallel_size
    if size == 1:
        return NO_TP, None
    path = resolve_model(config.model, Path(config.cache_dir))  # before any rank starts (converts once)
    hf = json.loads((path / "config.json").read_text())
    heads = hf.get("num_attention_heads", 0)
    check_divisible(heads, hf.get("num_key_value_heads") or heads, size)
    tp = env_rank()
    if tp is not None:
        if tp.size != size:
            raise ValueError(f"WORLD_SIZE is {tp.size} but --tensor-parallel-size is {size}: they must match")
        return tp, None
    group = spawn_local_ranks(size, config_to_argv(config))
    group.watch(lambda rank, code: end_group(f"tensor-parallel rank {rank} exited with status {code}", group))
    return TPInfo(0, size), group


def _listen(config: ExecutorConfig, loaded: Loaded, compute: futures.ThreadPoolExecutor, stop: threading.Event) -> None:
    address = f"{config.executor_host}:{config.executor_port}"
    interceptors = [SyncBearerTokenInterceptor(config.executor_token, TOKEN_DENIAL)] if config.executor_token else []
    if not interceptors:
        log.warning(
            "no executor token (CHUNKSERVE_EXECUTOR_TOKEN): any process that reaches %s can drive "
            "this executor; keep it on loopback or an internal network",
            address,
        )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    epb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(loaded, compute), server)
    # The standard health service, for Kubernetes gRPC probes and grpc_health_probe: the
    # server listens only once the model is loaded, so it is SERVING from its first answer.
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    for name in ("", SERVICE_NAME):
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:  # grpcio raises RuntimeError on a bind failure (older versions returned 0)
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ValueError(port_in_use(config.executor_host, config.executor_port))
    server.start()
    log.info(
        "executor listening on %s (pid %d%s)", address, os.getpid(), ", token required" if config.executor_token else ""
    )
    stop.wait()
    checker.enter_graceful_shutdown()  # NOT_SERVING while in-flight calls finish
    server.stop(grace=2).wait()
