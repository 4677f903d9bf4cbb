// Native float32 CPU ops for a decode step: paged decode attention and the K/V write straight
// on the paged cache, and the decoder's residual add + RMSNorm.
//
// Why native ops: a batch-1 decode step of a small model spends most of its non-GEMM time in
// per-op overhead, not arithmetic. The torch backend's decode attention is ~7 small aten ops
// per layer (gather K, scale q, bmm, mask, softmax, embedding_bag over V, views), each a
// dispatch and (with two threads) an OpenMP fork/join, and at 32 streams the gather and the
// expanded V rows read the cache more than once; F.rms_norm is a composite of ~6 ops (~14 us
// a call at one row) after a separate residual add. Here each (sequence, KV head) reads its
// keys and values once from the cache blocks, scored and summed in register tiles
// (cpu_attention_tiles.h says how), and a norm row is one pass of plain loops the compiler
// vectorises (-O3 -march=native; `omp simd` lets it reorder the float sums). Results differ from
// the aten path in the last bits, as two BLAS blockings do.
//
// Registered as torch.ops.chunkserve.{paged_decode_attention, write_kv, add_rms_norm}; built at
// the executor's first start by chunkserve_kernels/cpu_native.py and kept for later starts.

#include "cpu_ops.h"
#include "cpu_attention_tiles.h"

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

namespace chunkserve {
namespace {

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// A work item: the run's rows [d0, d0 + rows) for KV head h over tokens [t0, t1), a piece of a
// split context (piece > 0 or a row over split_tokens) or the whole.
struct Item {
  int64_t d0, rows, h, t0, t1, piece;
};

// One call's inputs as its work items read them.
struct Step {
  const float *q, *k, *v;
  float *out, *parts;  // parts: per piece of a split (row, KV head), see below
  const int32_t *ctx, *tables;
  const int64_t* first_part;
  int64_t max_blocks, bs, Hkv, Hq, group, hd, split, stride;
  float scale;
};

// A query vector of an item: where its result goes and how many of the item's tokens it sees.
struct Query {
  const float* q;
  float* dst;
  float* part;  // nullptr: a whole row, dst gets the normalised output
  int64_t g, n;
};

// Per thread, reused over its items.
struct Scratch {
  std::vector<Query> queries;
  std::vector<float> buf;
  std::vector<const float*> k, v;
  std::vector<int64_t> n;
};

// The item's query vectors, row by row (so their token counts ascend: a run's contexts do).
int64_t collect(const Step& st, const Item& it, std::vector<Query>& queries) {
  queries.clear();
  int64_t n_max = 0;
  for (int64_t d = it.d0; d < it.d0 + it.rows; ++d) {
    const int64_t ctx = st.ctx[d];
    const bool whole = ctx <= st.split;
    if (whole ? it.piece > 0 : ctx <= it.t0) continue;  // attended in another item
    const int64_t n = (whole ? ctx : std::min(ctx, it.t1)) - it.t0;
    float* part = whole ? nullptr : st.parts + (st.first_part[d * st.Hkv + it.h] + it.piece) * st.stride;
    float* dst = part == nullptr ? st.out + (d * st.Hq + it.h * st.group) * st.hd : part + 2 * st.group;
    for (int64_t g = 0; g < st.group; ++g)
      queries.push_back({st.q + (d * st.Hq + it.h * st.group + g) * st.hd, dst + g * st.hd, part, g, n});
    n_max = std::max(n_max, n);
  }
  return n_max;
}

// Row pointers for the item's tokens [0, n) (K or V per `base`), then zero rows up to `room`;
// where hd is not a whole number of vectors (hp floats), padded copies in `copy`.
void gather(const Step& st, const Item& it, const float* base, int64_t n, int64_t room, int64_t hp,
            const float* zero, float* copy, std::vector<const float*>& rows) {
  rows.assign(room, zero);
  const int32_t* table = st.tables + it.d0 * st.max_blocks;
  const int64_t step = st.Hkv * st.hd;  // from one token's row to the next in a block
  for (int64_t t = 0, b = it.t0 / st.bs, i = it.t0 % st.bs; t < n; ++t) {
    const float* row = base + (static_cast<int64_t>(table[b]) * st.bs * st.Hkv + it.h) * st.hd + i * step;
    if (hp != st.hd) {
      std::memcpy(copy + t * hp, row, st.hd * sizeof(float));
      row = copy + t * hp;
    }
    rows[t] = row;
    if (++i == st.bs) i = 0, ++b;
  }
  for (int64_t t = 0; t < std::min(n, kPrefetchAhead); ++t) prefetch_row(rows[t], hp);
}

// One work item: scores, softmax and value sums of its query vectors, each written to its row's
// output (a whole row) or its piece's `part` (max, sum of exp, unnormalised sum of p * V).
void attend(const Step& st, const Item& it, Scratch& s) {
  const int64_t n_max = collect(st, it, s.queries);
  const int64_t nq = static_cast<int64_t>(s.queries.size());
  const int64_t hp = (st.hd + kVec - 1) / kVec * kVec;  // head_dim in whole vectors
  const int64_t ls = (n_max + 2 * kVec - 1) / kVec * kVec;  // n_max, a tile's overrun, padding
  const int64_t copies = hp == st.hd ? 0 : 2 * n_max * hp;
  s.buf.resize(nq * (2 * hp + ls) + hp + copies + kLine);  // kLine: room to align q to 64 bytes
  float* q = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(s.buf.data()) + 63) & ~uintptr_t{63});
  float* scores = q + nq * hp;
  float* acc = scores + nq * ls;
  float* zero = acc + nq * hp;
  float* copy = zero + hp;
  std::fill(zero, copy, 0.f);
  if (hp != st.hd) std::fill(q, copy + copies, 0.f);  // the padding of q and of the row copies
  for (int64_t j = 0; j < nq; ++j) std::memcpy(q + j * hp, s.queries[j].q, st.hd * sizeof(float));
  gather(st, it, st.k, n_max, ls, hp, zero, copy, s.k);
  gather(st, it, st.v, n_max, n_max, hp, zero, copy + n_max * hp, s.v);
  scores_of(q, nq, hp, s.k.data(), s.v.data(), n_max, scores, ls, st.scale);
  s.n.resize(nq);
  for (int64_t j = 0; j < nq; ++j) {
    const Query& qr = s.queries[j];
    const auto [m, sum] = softmax(scores + j * ls, qr.n, qr.part == nullptr);
    if (qr.part != nullptr) {
      qr.part[qr.g] = m;
      qr.part[st.group + qr.g] = sum;
    }
    s.n[j] = qr.n;
  }
  values(scores, ls, s.n.data(), nq, s.v.data(), hp, acc);
  for (int64_t j = 0; j < nq; ++j) std::memcpy(s.queries[j].dst, acc + j * hp, st.hd * sizeof(float));
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
  const Step st{q_p,    k_p, v_p, out_p, part_buf.data(), ctx_p, bt_p, first_part.data(), max_blocks, bs,
                Hkv,    Hq,  group, hd,  split_tokens,    stride, sc};
  auto work = [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) attend(st, items[i], scratch);
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
