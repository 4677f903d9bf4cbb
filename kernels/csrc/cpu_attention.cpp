// Native float32 CPU ops for a decode step: paged decode attention and the K/V write straight
// on the paged cache, and the decoder's residual add + RMSNorm.
//
// Why native ops: a batch-1 decode step of a small model spends most of its non-GEMM time in
// per-op overhead, not arithmetic. The torch backend's decode attention is ~7 small aten ops
// per layer (gather K, scale q, bmm, mask, softmax, embedding_bag over V, views), each a
// dispatch and (with two threads) an OpenMP fork/join, and at 32 streams the gather and the
// expanded V rows read the cache more than once; F.rms_norm is a composite of ~6 ops (~14 us
// a call at one row) after a separate residual add. Here each (sequence, KV head) reads its
// keys and values once from the cache blocks, and a norm row is one pass. Plain loops: the
// compiler vectorises them (-O3 -march=native; `omp simd` lets it reorder the float sums, so
// results differ from the aten path in the last bits, as two BLAS blockings do).
//
// Registered as torch.ops.chunkserve.{paged_decode_attention, write_kv, add_rms_norm}; built at
// the executor's first start by chunkserve_kernels/cpu_native.py and kept for later starts.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

// glibc's vector expf (libmvec), declared as its <math.h> does under -ffast-math, so that the
// softmax loop vectorises without -ffast-math (which would also assume no infinities, and on
// GCC < 13 link crtfastmath into the library, switching the whole process to flush-to-zero).
#pragma omp declare simd notinbranch
extern "C" float expf(float) noexcept;

namespace chunkserve {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// How many tokens ahead the loops over a sequence's rows prefetch: enough to keep a few dozen
// cache misses in flight (the rows are scattered over the blocks and mostly not in cache: a
// step's weights have just streamed through it), few enough that what is prefetched is still
// in L1 when it is used (prefetching a whole long context ahead evicted its first rows: at 32
// streams x 400 tokens that was 1.1-1.3x slower than the aten path).
constexpr int64_t kPrefetchAhead = 16;


// The row of head h for token t of a sequence with block table `table` (K or V per `base`).
inline const float* row_of(const float* base, const int32_t* table, int64_t t, int64_t bs, int64_t Hkv, int64_t h,
                           int64_t hd) {
  return base + ((static_cast<int64_t>(table[t / bs]) * bs + t % bs) * Hkv + h) * hd;
}

inline void prefetch_row(const float* row, int64_t hd) {
  constexpr int64_t kLine = 64 / sizeof(float);
  for (int64_t i = 0; i < hd; i += kLine) __builtin_prefetch(row + i, 0, 3);
}

void check_cache(const at::Tensor& cache) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kFloat, "cache must be a float32 CPU tensor");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] layer, got ",
              cache.sizes());
}

// Copies row `src` (hd floats at element stride `step`) to `dst`.
inline void copy_row(float* dst, const float* src, int64_t step, int64_t hd) {
  if (step == 1) {
    std::memcpy(dst, src, hd * sizeof(float));
  } else {
    for (int64_t i = 0; i < hd; ++i) dst[i] = src[i * step];
  }
}

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

}  // namespace

// q [D, Hq, hd] (one decode token per sequence; any strides),
// cache [2, num_blocks, block_size, Hkv, hd], block_table [D, max_blocks] int32,
// context_lens [D] int32 (including this step's token, already written). -> [D, Hq, hd];
// (sequence, KV head) units, a context over `split_tokens` in pieces of that many tokens, over
// torch's threads above `serial_max_rows` key rows (cpu_ops.h says why both).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale, int64_t serial_max_rows,
                                  int64_t split_tokens) {
  check_cache(cache);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(), "q must be float32 [D, Hq, hd]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_table and context_lens must be int32");
  const int64_t D = q.size(0), Hq = q.size(1), hd = q.size(2);
  const int64_t num_blocks = cache.size(1), bs = cache.size(2), Hkv = cache.size(3);
  TORCH_CHECK(cache.size(4) == hd, "head_dim of q (", hd, ") and cache (", cache.size(4), ") differ");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads (", Hq, ") must be a multiple of KV heads (", Hkv, ")");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == D && context_lens.numel() == D,
              "block_table [D, max_blocks] and context_lens [D] must match q's D = ", D);
  TORCH_CHECK(split_tokens >= 1, "split_tokens must be positive, got ", split_tokens);
  const at::Tensor qc = q.contiguous();
  const at::Tensor bt = block_table.contiguous();
  const at::Tensor cl = context_lens.contiguous();
  const int64_t max_blocks = bt.size(1), group = Hq / Hkv;
  const int32_t* ctx_p = cl.data_ptr<int32_t>();
  const int32_t* bt_p = bt.data_ptr<int32_t>();
  int64_t rows = 0;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t ctx = ctx_p[d];
    TORCH_CHECK(ctx >= 1 && (ctx + bs - 1) / bs <= max_blocks, "context length ", ctx, " of sequence ", d,
                " does not fit its ", max_blocks, " blocks");
    for (int64_t b = 0; b < (ctx + bs - 1) / bs; ++b) {
      const int32_t blk = bt_p[d * max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " outside the cache's ", num_blocks, " blocks");
    }
    rows += ctx * Hkv;
  }
  at::Tensor out = at::empty({D, Hq, hd}, q.options());
  const float* q_p = qc.data_ptr<float>();
  const float* k_p = cache.data_ptr<float>();
  const float* v_p = k_p + num_blocks * bs * Hkv * hd;
  float* out_p = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // Runs: consecutive rows with one block table and context lengths c, c + 1, ... are one
  // sequence's decode and its draft tokens (a verify step, executor_svc/runner.py); a run's
  // work items read each K and V row once for all its rows. Each row still gets exactly what
  // it alone would: its own pieces (below), the same sums in the same order.
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
  for (int64_t d = 0; d < D; ++d) {
    if (!runs.empty()) {
      auto& [d0, r] = runs.back();
      if (ctx_p[d] == ctx_p[d - 1] + 1 &&
          std::memcmp(bt_p + d * max_blocks, bt_p + d0 * max_blocks, max_blocks * sizeof(int32_t)) == 0) {
        ++r;
        continue;
      }
    }
    runs.emplace_back(d, 1);
  }

  // Work items: a (run, KV head) unit whole, or one split_tokens piece of a longer one. A row
  // whose context is at most split_tokens is attended whole and writes its normalised output;
  // a longer row's piece leaves, per query head of the group, its max score, its sum of
  // exp(score - max) and its unnormalised sum of p * V in `part` (group x (hd + 2) floats),
  // merged below. Which rows split, and where, depends on their own context length only, so
  // a sequence's result does not depend on the batch, its drafts or the thread count.
  struct Item {
    int64_t d0, rows, h, t0, t1, piece;  // run rows [d0, d0 + rows), tokens [t0, t1), piece index
  };
  std::vector<Item> items;
  std::vector<int64_t> first_part(D * Hkv, -1);
  int64_t parts = 0;
  for (int64_t w = 0; w < D * Hkv; ++w) {
    const int64_t ctx = ctx_p[w / Hkv];
    if (ctx > split_tokens) {
      first_part[w] = parts;
      parts += (ctx + split_tokens - 1) / split_tokens;
    }
  }
  for (const auto& [d0, r] : runs) {
    const int64_t longest = ctx_p[d0 + r - 1];
    for (int64_t h = 0; h < Hkv; ++h) {
      if (longest <= split_tokens) {
        items.push_back({d0, r, h, 0, longest, 0});
        continue;
      }
      for (int64_t t0 = 0, p = 0; t0 < longest; t0 += split_tokens, ++p)
        items.push_back({d0, r, h, t0, std::min(longest, t0 + split_tokens), p});
    }
  }
  const int64_t stride = group * (hd + 2);
  std::vector<float> part_buf(parts * stride);

  auto work = [&](int64_t begin, int64_t end) {
    struct Row {
      const float* q;
      float* out;
      float* part;  // nullptr: a whole row
      int64_t n;    // its tokens in this item, from t0
      std::vector<float> probs;
    };
    std::vector<Row> rows_here;
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64_t h = it.h, t0 = it.t0;
      const int32_t* table = bt_p + it.d0 * max_blocks;
      rows_here.clear();
      int64_t n_max = 0;
      for (int64_t d = it.d0; d < it.d0 + it.rows; ++d) {
        const int64_t ctx = ctx_p[d];
        const bool whole = ctx <= split_tokens;
        if (whole ? it.piece > 0 : ctx <= t0) continue;  // attended in another item
        const int64_t n = (whole ? ctx : std::min(ctx, it.t1)) - t0;
        float* part = whole ? nullptr : part_buf.data() + (first_part[d * Hkv + h] + it.piece) * stride;
        rows_here.push_back({q_p + (d * Hq + h * group) * hd,
                             part == nullptr ? out_p + (d * Hq + h * group) * hd : part + 2 * group, part, n,
                             std::vector<float>(group * n)});
        n_max = std::max(n_max, n);
      }
      for (int64_t t = 0; t < std::min(n_max, kPrefetchAhead); ++t)
        prefetch_row(row_of(k_p, table, t0 + t, bs, Hkv, h, hd), hd);
      for (int64_t t = 0; t < n_max; ++t) {
        if (t + kPrefetchAhead < n_max) prefetch_row(row_of(k_p, table, t0 + t + kPrefetchAhead, bs, Hkv, h, hd), hd);
        const float* k = row_of(k_p, table, t0 + t, bs, Hkv, h, hd);
        for (Row& row : rows_here) {
          if (t >= row.n) continue;
          for (int64_t g = 0; g < group; ++g) row.probs[g * row.n + t] = dot(row.q + g * hd, k, hd) * sc;
        }
      }
      for (int64_t t = 0; t < std::min(n_max, kPrefetchAhead); ++t)
        prefetch_row(row_of(v_p, table, t0 + t, bs, Hkv, h, hd), hd);
      for (Row& row : rows_here) {
        const int64_t n = row.n;
        for (int64_t g = 0; g < group; ++g) {
          float* p = row.probs.data() + g * n;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) m = std::max(m, p[t]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            p[t] = expf(p[t] - m);
            sum += p[t];
          }
          if (row.part == nullptr) {
            const float inv = 1.f / sum;
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) p[t] *= inv;
          } else {
            row.part[g] = m;
            row.part[group + g] = sum;
          }
          std::fill(row.out + g * hd, row.out + (g + 1) * hd, 0.f);
        }
      }
      for (int64_t t = 0; t < n_max; ++t) {
        if (t + kPrefetchAhead < n_max) prefetch_row(row_of(v_p, table, t0 + t + kPrefetchAhead, bs, Hkv, h, hd), hd);
        const float* v = row_of(v_p, table, t0 + t, bs, Hkv, h, hd);
        for (Row& row : rows_here) {
          if (t >= row.n) continue;
          for (int64_t g = 0; g < group; ++g) axpy(row.out + g * hd, row.probs[g * row.n + t], v, hd);
        }
      }
    }
  };
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (rows <= serial_max_rows) {
    work(0, num_items);
  } else {
    at::parallel_for(0, num_items, 1, work);
  }
  // Merge the pieces of each split unit, in order: out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c.
  for (int64_t w = 0; w < D * Hkv; ++w) {
    if (first_part[w] < 0) continue;
    const int64_t d = w / Hkv, h = w % Hkv;
    const int64_t count = (ctx_p[d] + split_tokens - 1) / split_tokens;
    const float* first = part_buf.data() + first_part[w] * stride;
    for (int64_t g = 0; g < group; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < count; ++c) top = std::max(top, first[c * stride + g]);
      float total = 0.f;
      for (int64_t c = 0; c < count; ++c) total += expf(first[c * stride + g] - top) * first[c * stride + group + g];
      float* oh = out_p + (d * Hq + h * group + g) * hd;
      std::fill(oh, oh + hd, 0.f);
      for (int64_t c = 0; c < count; ++c) {
        const float f = expf(first[c * stride + g] - top) / total;
        axpy(oh, f, first + c * stride + 2 * group + g * hd, hd);
      }
    }
  }
  return out;
}

// Stores k, v [T, Hkv, hd] (any strides: the model's are views, transposed ones under the
// CPU GEMM's (W @ x^T)^T) at flat slots slot_mapping [T] int64 of a cache layer
// [2, num_blocks, block_size, Hkv, hd], in place.
void write_kv(const at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  check_cache(cache);
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "k and v must be float32");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "slot_mapping must be int64 [T]");
  const int64_t T = slot_mapping.size(0), Hkv = cache.size(3), hd = cache.size(4);
  const int64_t slots = cache.size(1) * cache.size(2);
  TORCH_CHECK(k.dim() == 3 && k.size(0) == T && k.size(1) == Hkv && k.size(2) == hd && k.sizes() == v.sizes(),
              "k and v must be [T, num_kv_heads, head_dim] = [", T, ", ", Hkv, ", ", hd, "]");
  const at::Tensor sm = slot_mapping.contiguous();
  const int64_t* sm_p = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sm_p[t] >= 0 && sm_p[t] < slots, "slot ", sm_p[t], " outside the cache's ", slots, " slots");
  }
  float* k_dst = cache.data_ptr<float>();
  float* v_dst = k_dst + slots * Hkv * hd;
  const float* k_src = k.data_ptr<float>();
  const float* v_src = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = sm_p[t];
    for (int64_t h = 0; h < Hkv; ++h) {
      copy_row(k_dst + (s * Hkv + h) * hd, k_src + t * k.stride(0) + h * k.stride(1), k.stride(2), hd);
      copy_row(v_dst + (s * Hkv + h) * hd, v_src + t * v.stride(0) + h * v.stride(1), v.stride(2), hd);
    }
  }
}

// (x + residual) and RMSNorm of it, per row: returns (weight * (s / sqrt(mean(s^2) + eps)), s)
// with s = x + residual (x alone when residual is None). x, residual [M, N] float32 or bfloat16
// (bfloat16 widens exactly, as `h + y` promotes it); weight [N] float32. Each row is one task
// and its result does not depend on the other rows; the sum of squares is reordered for
// vectorisation (so not bitwise F.rms_norm's; the adds and multiplies are elementwise-exact).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a CPU [M, N] tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == x.size(1),
              "weight must be float32 [N]");
  const int64_t M = x.size(0), N = x.size(1);
  at::Tensor s = at::empty({M, N}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const at::Tensor w = weight.contiguous();
  const float* w_p = w.data_ptr<float>();
  float* s_p = s.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  auto load_row = [](const at::Tensor& t, int64_t i, float* dst, bool add) {
    const int64_t n = t.size(1), st = t.stride(1);
    if (t.scalar_type() == at::kFloat) {
      const float* src = t.data_ptr<float>() + i * t.stride(0);
      if (add) {
        for (int64_t j = 0; j < n; ++j) dst[j] += src[j * st];
      } else {
        for (int64_t j = 0; j < n; ++j) dst[j] = src[j * st];
      }
    } else {
      TORCH_CHECK(t.scalar_type() == at::kBFloat16, "x and residual must be float32 or bfloat16");
      const at::BFloat16* src = t.data_ptr<at::BFloat16>() + i * t.stride(0);
      if (add) {
        for (int64_t j = 0; j < n; ++j) dst[j] += widen(src[j * st]);
      } else {
        for (int64_t j = 0; j < n; ++j) dst[j] = widen(src[j * st]);
      }
    }
  };
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N,
                "residual must be [M, N] like x");
  }
  const float e = static_cast<float>(eps);
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = s_p + i * N;
      // residual + x in that order: float addition is commutative, so bitwise `h + y`
      load_row(residual.has_value() ? *residual : x, i, row, false);
      if (residual.has_value()) load_row(x, i, row, true);
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < N; ++j) sq += row[j] * row[j];
      const float r = 1.f / std::sqrt(sq / static_cast<float>(N) + e);
      float* o = o_p + i * N;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) o[j] = w_p[j] * (row[j] * r);
    }
  };
  if (M * N <= 64 * 1024) {
    work(0, M);
  } else {
    at::parallel_for(0, M, 16, work);
  }
  return {out, s};
}

}  // namespace chunkserve

TORCH_LIBRARY(chunkserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor cache, Tensor block_table, Tensor context_lens, float scale, "
      "int serial_max_rows=256, int split_tokens=512) -> Tensor");
  m.def("write_kv(Tensor(a!) cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(chunkserve, CPU, m) {
  m.impl("paged_decode_attention", &chunkserve::paged_decode_attention);
  m.impl("write_kv", &chunkserve::write_kv);
  m.impl("add_rms_norm", &chunkserve::add_rms_norm);
}
