// The native float32 CPU ops, for the translation units that call one another's (the fused
// decode layer, cpu_layer.cpp, runs the others in sequence without a Python call between them).
// Each is also registered as torch.ops.chunkserve.<name>; see its source for what it computes.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace chunkserve {

// cpu_attention.cpp
// Up to this many key rows (sequences x KV heads x context) the decode attention runs on the
// calling thread, where a fork/join would cost more than the work (the op's schema default
// says the same number). It was 4096, the aten path's SINGLE_THREAD_MAX_ROWS in
// kernels/torch_backend.py, whose ops fork once each; this op forks once per call, and with its
// (sequence, KV head) units over 2 threads the 30 layers' decode attention of one sequence took
// 0.83x / 0.78x as long at 128 / 1024 tokens of context, the same results bitwise
// (benchmarks/decode_attention_threads.py; benchmarks/RESULTS.md).
constexpr int64_t kSerialMaxRows = 256;
// A sequence's context longer than this is attended in pieces of this many tokens, one work item
// each, merged after (flash-decoding's split): one decoding sequence's 3 KV heads on 2 threads
// are otherwise 2 units against 1. The split follows the sequence's own length only, so its
// result does not depend on the batch or the thread count (the op's schema default says the
// same number). Pieces of 256 / 512 / 1024 tokens against none, one sequence at 1024 tokens:
// 0.80x / 0.76x / 0.97x; 8 sequences at 1024-2048 tokens (already balanced): 1.05x / 1.03-1.05x /
// 0.98-1.03x (benchmarks/decode_attention_threads.py; benchmarks/RESULTS.md).
constexpr int64_t kSplitTokens = 512;
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t serial_max_rows = kSerialMaxRows, int64_t split_tokens = kSplitTokens);
void write_kv(const at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);

// cpu_rotary.cpp
// q, k of a step's fused projection [T, heads + 2 kv_heads, head_dim] rotated by the rows at
// `positions` (int64 [T]) of the full-width [positions, head_dim] cos / sin tables (apply_rotary's
// arithmetic, bitwise), k and v written at slot_mapping into the cache layer; -> the rotated q
// [T, heads, head_dim].
at::Tensor rotary_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                     const at::Tensor& cache, const at::Tensor& slot_mapping, int64_t heads);

// cpu_silu.cpp
// silu(gate) * up for gate_up [T, 2 x intermediate] (the fused projection's halves) -> [T,
// intermediate], bitwise aten's silu and multiply where `silu_mul_matches_aten()` (checked on
// probe values in this process) and the step is under at::internal::GRAIN_SIZE elements.
at::Tensor silu_mul(const at::Tensor& gate_up);
bool silu_mul_matches_aten();

// cpu_argmax.cpp
// The first index of each row's largest value (a row with a NaN: its first NaN), int64 [N], for
// float32 logits [N, V] with contiguous rows: aten's argmax(dim=-1), exactly.
at::Tensor greedy_argmax(const at::Tensor& logits);

// cpu_linear.cpp
// stream_one_row: a single row of x reads the weights without asking for lines ahead (the plan's
// "gemv-stream"; several rows always ask).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                bool stream_one_row = false);

}  // namespace chunkserve
