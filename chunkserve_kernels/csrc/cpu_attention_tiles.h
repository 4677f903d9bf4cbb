// The vector kernels of the native decode attention (cpu_attention.cpp, the only file that
// includes this): a work item's scores, softmax and value sums over its query vectors (a row's
// query group, or the rows of a verify run) and tokens.
//
// Why tiles: one query vector against one K row is 4 vector multiply-adds and a horizontal
// reduction, and the first version spent most of its time on those reductions and on reloading
// the K row per query head, and in the value sum on loading and storing the output per token.
// Here a K chunk loaded once feeds one product per vector lane (AVX-512: 16, as 4 query vectors
// x 4 tokens, or 3 x 5, ...; AVX2: 8, as 4 x 2, 2 x 4, ...), whose reductions share one
// shuffle-and-add tree, and the value sums of up to 6 query vectors stay in registers over a pass
// of tokens. A score or value sum is still computed in one fixed order
// whatever the tile (see below), so a row gets the same bits alone as in a run or a batch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

// glibc's vector expf (libmvec), declared as its <math.h> does under -ffast-math, so that the
// softmax loop vectorises without -ffast-math (which would also assume no infinities, and on
// GCC < 13 link crtfastmath into the library, switching the whole process to flush-to-zero).
#pragma omp declare simd notinbranch
extern "C" float expf(float) noexcept;

namespace chunkserve {
namespace {  // one translation unit includes this

// One register of floats: 16 with AVX-512, 8 otherwise (GCC's vector extension, as in
// cpu_linear.cpp: no intrinsics, so the file builds for any -march; loads through memcpy are
// unaligned loads). The width follows the target: GCC lowers a vector wider than the machine's
// registers through the stack, and with 16-float vectors on a 2-core AVX2 EPYC one decoding
// row's attention over 128 tokens took 155 us a layer, in cache (benchmarks/RESULTS.md, "The
// native kernels on AVX2"). A score's lanes, and so the order of its sum, follow the width: the
// same bits for the same inputs on one machine, not across ISAs.
#if defined(__AVX512F__)
constexpr int64_t kVec = 16;
#else
constexpr int64_t kVec = 8;
#endif
typedef float Vec __attribute__((vector_size(kVec * sizeof(float))));
typedef int Lanes __attribute__((vector_size(kVec * sizeof(int))));
constexpr int64_t kLine = 16;  // floats in a cache line: the prefetches' stride
// Tokens per pass of the score and value loops over a work item: the first tile of query
// vectors reads a pass's K (V) rows from memory, the others from L1 (80 rows of 64 floats:
// 20 KB). A multiple of every score tile's token count
// (AVX-512: 4, 5, 8, 16; AVX2: 2, 4, 8).
constexpr int64_t kBlock = 80;
// Query vectors whose value sums a tile keeps in registers, over up to kValueChunks vectors of
// the head at once (AVX-512: 6 x 4 of 16 floats; AVX2, 16 registers: 6 x 2 of 8).
constexpr int kValueTile = 6;
constexpr int kValueChunks = kVec == 16 ? 4 : 2;
static_assert(kValueChunks == 2 || kValueChunks == 4, "value_tile_cw takes 1-2 or 1-4 chunks");
// How many tokens ahead the loops over a sequence's rows prefetch: enough to keep a few dozen
// cache misses in flight (the rows are scattered over the blocks and mostly not in cache: a
// step's weights have just streamed through it), few enough that what is prefetched is still
// in L1 when it is used (prefetching a whole long context ahead evicted its first rows: at 32
// streams x 400 tokens that was 1.1-1.3x slower than the aten path).
constexpr int64_t kPrefetchAhead = 16;

inline void prefetch_row(const float* row, int64_t hd) {
  for (int64_t i = 0; i < hd; i += kLine) __builtin_prefetch(row + i, 0, 3);
}

// The kernels below are compiled without -fassociative-math: each sum is computed in the order
// written, whatever the tile shape or call site, so a query row's result is a function of its
// own inputs only (a run of draft rows is tiled otherwise than a row alone).
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// One step of the butterfly below: in each block of 2W lanes of the result, the first W lanes
// are x's block with its halves added, the next W y's.
template <int W>
inline Vec fold(Vec x, Vec y) {
  Lanes lo;
  for (int i = 0; i < kVec; ++i) lo[i] = (i / (2 * W)) * 2 * W + (i % (2 * W) < W ? i % (2 * W) : kVec + i % W);
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, lo + W);
}

// Lane i of the result is the sum of a[i]'s kVec lanes, every one by the same tree (lanes j and
// j + kVec / 2, then + kVec / 4, ..., + 1): kVec - 1 adds for kVec sums instead of kVec separate
// reductions. The butterfly leaves a[i] in lane bitreverse(i), so it takes them in that order.
#if defined(__AVX512F__)
__attribute__((always_inline)) inline Vec reduce_lanes(const Vec* a) {
  constexpr int kRev[kVec] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  Vec b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m) b[m] = fold<8>(a[kRev[2 * m]], a[kRev[2 * m + 1]]);
  for (int m = 0; m < 4; ++m) c[m] = fold<4>(b[2 * m], b[2 * m + 1]);
  for (int m = 0; m < 2; ++m) d[m] = fold<2>(c[2 * m], c[2 * m + 1]);
  return fold<1>(d[0], d[1]);
}
#else
__attribute__((always_inline)) inline Vec reduce_lanes(const Vec* a) {
  constexpr int kRev[kVec] = {0, 4, 2, 6, 1, 5, 3, 7};
  Vec c[4], d[2];
  for (int m = 0; m < 4; ++m) c[m] = fold<4>(a[kRev[2 * m]], a[kRev[2 * m + 1]]);
  for (int m = 0; m < 2; ++m) d[m] = fold<2>(c[2 * m], c[2 * m + 1]);
  return fold<1>(d[0], d[1]);
}
#endif

// Scores of QT query vectors (rows of q, hd floats, a multiple of kVec) against the K rows
// k[0, TT): s[i * ls + j] = scale * (q_i . k_j). Each K chunk feeds QT products, each q chunk TT;
// lane l of a product sums the head's dimensions l, l + kVec, ... in order, and the lanes are
// added by reduce_lanes, the same for every (i, j) of every tile shape.
template <int QT, int TT>
void score_tile(const float* q, int64_t hd, const float* const* k, float* s, int64_t ls, float scale) {
  static_assert(QT * TT <= kVec, "one reduce_lanes per tile");
  Vec acc[kVec] = {};
  for (int64_t c = 0; c < hd; c += kVec) {
    Vec kc[TT];
    for (int j = 0; j < TT; ++j) kc[j] = load(k[j] + c);
    for (int i = 0; i < QT; ++i) {
      const Vec qc = load(q + i * hd + c);
      for (int j = 0; j < TT; ++j) acc[i * TT + j] += qc * kc[j];
    }
  }
  float sums[kVec];
  store(sums, reduce_lanes(acc));
  for (int i = 0; i < QT; ++i)
    for (int j = 0; j < TT; ++j) s[i * ls + j] = sums[i * TT + j] * scale;
}

// score_tile over tokens [t0, t1) (whole tiles: up to TT - 1 past t1, onto the padding rows);
// with `ahead` > 0 it prefetches the K rows that far ahead into L1 and the V rows into L2 (up
// to `last`): the value sums find them there, and twice the misses are in flight meanwhile.
template <int QT, int TT>
void score_span(const float* q, int64_t hd, const float* const* k, const float* const* v, int64_t t0, int64_t t1,
                float* s, int64_t ls, float scale, int64_t ahead, int64_t last) {
  for (int64_t t = t0; t < t1; t += TT) {
    for (int64_t u = t + ahead; ahead > 0 && u < std::min(t + ahead + TT, last); ++u) {
      prefetch_row(k[u], hd);
      for (int64_t i = 0; i < hd; i += kLine) __builtin_prefetch(v[u] + i, 0, 2);
    }
    score_tile<QT, TT>(q, hd, k + t, s + t, ls, scale);
  }
}

// acc[i] (CW chunks of kVec from column c) += sum over tokens [t0, t1) of p[i * lp + t] * v[t],
// for QT query vectors (acc rows hd apart): the sums stay in registers over the tokens, each V
// chunk feeding QT multiply-adds. Lane by lane, in token order, whatever QT and CW are.
template <int QT, int CW>
void value_tile(float* acc, const float* p, int64_t lp, const float* const* v, int64_t c, int64_t hd, int64_t t0,
                int64_t t1, int64_t last) {
  Vec a[QT][CW];
  for (int i = 0; i < QT; ++i)
    for (int j = 0; j < CW; ++j) a[i][j] = load(acc + i * hd + c + j * kVec);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kPrefetchAhead < last)
      for (int j = 0; j < CW * kVec; j += kLine) __builtin_prefetch(v[t + kPrefetchAhead] + c + j, 0, 3);
    Vec vc[CW];
    for (int j = 0; j < CW; ++j) vc[j] = load(v[t] + c + j * kVec);
    for (int i = 0; i < QT; ++i) {
      const Vec pi = Vec{} + p[i * lp + t];
      for (int j = 0; j < CW; ++j) a[i][j] += pi * vc[j];
    }
  }
  for (int i = 0; i < QT; ++i)
    for (int j = 0; j < CW; ++j) store(acc + i * hd + c + j * kVec, a[i][j]);
}

template <int QT>
void value_tile_cw(int64_t cw, float* acc, const float* p, int64_t lp, const float* const* v, int64_t c, int64_t hd,
                   int64_t t0, int64_t t1, int64_t last) {
  // cw is 1..kValueChunks (value_span's choice)
  if constexpr (kValueChunks == 2) {
    if (cw == 1) value_tile<QT, 1>(acc, p, lp, v, c, hd, t0, t1, last);
    else value_tile<QT, 2>(acc, p, lp, v, c, hd, t0, t1, last);
  } else {
    switch (cw) {
      case 1: value_tile<QT, 1>(acc, p, lp, v, c, hd, t0, t1, last); break;
      case 2: value_tile<QT, 2>(acc, p, lp, v, c, hd, t0, t1, last); break;
      case 3: value_tile<QT, 3>(acc, p, lp, v, c, hd, t0, t1, last); break;
      default: value_tile<QT, 4>(acc, p, lp, v, c, hd, t0, t1, last); break;
    }
  }
}

// value_tile for qt (1..kValueTile) query vectors over all of the head's chunks, kValueChunks
// at a time; prefetching ahead only when `last` > 0.
void value_span(int64_t qt, float* acc, const float* p, int64_t lp, const float* const* v, int64_t hd, int64_t t0,
                int64_t t1, int64_t last) {
  for (int64_t c = 0; c < hd; c += kValueChunks * kVec) {
    const int64_t cw = std::min<int64_t>(kValueChunks, (hd - c) / kVec);
    switch (qt) {
      case 1: value_tile_cw<1>(cw, acc, p, lp, v, c, hd, t0, t1, last); break;
      case 2: value_tile_cw<2>(cw, acc, p, lp, v, c, hd, t0, t1, last); break;
      case 3: value_tile_cw<3>(cw, acc, p, lp, v, c, hd, t0, t1, last); break;
      case 4: value_tile_cw<4>(cw, acc, p, lp, v, c, hd, t0, t1, last); break;
      case 5: value_tile_cw<5>(cw, acc, p, lp, v, c, hd, t0, t1, last); break;
      default: value_tile_cw<6>(cw, acc, p, lp, v, c, hd, t0, t1, last); break;
    }
  }
}

// Scores of nq query vectors (rows of q, hd floats) against the K rows k[0, n) into s (rows ls
// apart; v: the V rows, to prefetch), in passes of kBlock tokens; per pass, tiles of 4 query
// vectors x kVec / 4 tokens (the last tile of 3, 2 or 1 vectors x the most tokens that fit in
// kVec products). k has padding rows up to a tile past n.
void scores_of(const float* q, int64_t nq, int64_t hd, const float* const* k, const float* const* v, int64_t n,
               float* s, int64_t ls, float scale) {
  for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
    const int64_t t1 = std::min(n, t0 + kBlock);
    for (int64_t i = 0; i < nq; i += 4) {
      const float* qi = q + i * hd;
      float* si = s + i * ls;
      const int64_t ahead = i == 0 ? kPrefetchAhead : 0;  // the first tile reads from memory
      switch (std::min<int64_t>(nq - i, 4)) {
        case 4: score_span<4, kVec / 4>(qi, hd, k, v, t0, t1, si, ls, scale, ahead, n); break;
        case 3: score_span<3, kVec == 16 ? 5 : 2>(qi, hd, k, v, t0, t1, si, ls, scale, ahead, n); break;
        case 2: score_span<2, kVec / 2>(qi, hd, k, v, t0, t1, si, ls, scale, ahead, n); break;
        default: score_span<1, kVec>(qi, hd, k, v, t0, t1, si, ls, scale, ahead, n); break;
      }
    }
  }
}

// The softmax of p[0, n) in place (p aligned to a vector, room for n rounded up to kVec), its max
// and sum of exp(p - max) returned; normalised when `normalise`. Every value goes through the
// same vector expf (whole chunks of kVec, the padding at -inf), the sum lane by lane then over
// the lanes in order: the same bits for the same scores wherever they sit.
std::pair<float, float> softmax(float* p_in, int64_t n, bool normalise) {
  float* p = static_cast<float*>(__builtin_assume_aligned(p_in, sizeof(Vec)));
  const int64_t padded = (n + kVec - 1) / kVec * kVec;
  std::fill(p + n, p + padded, -std::numeric_limits<float>::infinity());
  Vec top = load(p);
  for (int64_t c = kVec; c < padded; c += kVec) {
    const Vec x = load(p + c);
    top = top > x ? top : x;
  }
  float m = top[0];
  for (int64_t i = 1; i < kVec; ++i) m = std::max(m, top[i]);
  Vec sum{};
  for (int64_t c = 0; c < padded; c += kVec) {
    float* x = p + c;
#pragma omp simd
    for (int64_t i = 0; i < kVec; ++i) x[i] = expf(x[i] - m);
    sum += load(x);
  }
  float total = 0.f;
  for (int64_t i = 0; i < kVec; ++i) total += sum[i];
  if (normalise) {
    const float inv = 1.f / total;
    for (int64_t c = 0; c < padded; c += kVec) store(p + c, load(p + c) * inv);
  }
  return {m, total};
}

// acc[i] = sum over t < n[i] of p[i * lp + t] * v[t] for nq query vectors (n ascending), in
// passes of kBlock tokens and tiles of up to kValueTile vectors; where the tile's vectors have
// fewer tokens than its last, the tile narrows to those still going.
void values(const float* p, int64_t lp, const int64_t* n, int64_t nq, const float* const* v, int64_t hd,
            float* acc) {
  std::fill(acc, acc + nq * hd, 0.f);
  const int64_t last = n[nq - 1];
  for (int64_t t0 = 0; t0 < last; t0 += kBlock) {
    for (int64_t i = 0; i < nq; i += kValueTile) {
      const int64_t end = std::min(nq, i + kValueTile);
      int64_t t = t0;
      for (int64_t j = i; j < end; ++j) {
        const int64_t upto = std::min(n[j], t0 + kBlock);
        if (upto <= t) continue;
        value_span(end - j, acc + j * hd, p + j * lp, lp, v, hd, t, upto, i == 0 ? last : 0);
        t = upto;
      }
    }
  }
}

#pragma GCC pop_options

}  // namespace
}  // namespace chunkserve
