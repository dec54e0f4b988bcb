// The arithmetic of one query row's attention over the paged pool, shared by decode_attention.cpp and
// prefill_attention.cpp: both kernels call attend_row for each query row (its G query heads, over one KV head), so
// a row's numbers are one function of its query and its keys, whether a decode step or a prefill computes it.
// (decode_attention.cpp's header says what the pool formats and the wide loop are.)
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "isa.h"

namespace kvreuse_attention {

// exp(x) for x <= 0 (Cephes' expf: n = round(x / ln 2), a degree-7 polynomial on the rest, times 2^n), inline so
// that the softmax loop vectorizes; within 2 ulp of expf. glibc's vector expf needs -ffast-math.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Keys are read through the block table, a few hundred bytes at a time from scattered slots, which the hardware's
// prefetcher does not follow: each loop asks for the row kAhead keys on (8 sequences over 1,000 keys, caches
// evicted: 30 layers in 31.1 ms instead of 34.6; no change at 160 keys).
constexpr int64_t kAhead = 8;
// The wide loop spends a few times less per key, so it asks further ahead (b8 x 8k, int8 pool: 24 keys ahead
// instead of 8 measured in docs/features/kv-dtype.md).
constexpr int64_t kAheadWide = 24;

// A row's bytes (`width` codes of one byte or more), a few cache lines.
template <typename C>
__attribute__((always_inline)) inline void prefetch_row(const C* p, int64_t width) {
  for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(C)); b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 3);
}

// ---- The row types: what a stored code is worth, and its group's scale ----
// A row type R has Code (the pool's element), kMaxCode (0: values stored as they are), value(code) and
// scale(row, D, group_index). A value is value(code) * scale (an exact * 1 in a plain row, one group of D).

template <typename T>
struct PlainRows {  // fp32 or bf16 values, as the model computed them
  using Code = T;
  static constexpr float kMaxCode = 0.f;
  static float value(Code c) { return static_cast<float>(c); }
  static float scale(const Code*, int64_t, int64_t) { return 1.f; }
  static Code encode(float x) { return static_cast<Code>(x); }
};

template <typename C>
__attribute__((always_inline)) inline float group_scale(const C* row, int64_t D, int64_t group_index) {
  return static_cast<float>(reinterpret_cast<const c10::Half*>(row + D)[group_index]);  // fp16 after D codes
}

struct Int8Rows {
  using Code = int8_t;
  static constexpr float kMaxCode = 127.f;
  static float value(Code c) { return static_cast<float>(c); }
  static float scale(const Code* row, int64_t D, int64_t g) { return group_scale(row, D, g); }
  // x already scaled and clamped to +-127: round half to even, as torch.round
  static Code encode(float x) { return static_cast<Code>(std::nearbyint(x)); }
};

// float8_e4m3fn's 256 codes as floats (0x7f and 0xff are NaN; encode never writes them)
const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> values{};
  for (int c = 0; c < 256; ++c) values[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c),
                                                                                   c10::Float8_e4m3fn::from_bits()));
  return values;
}();

struct Fp8Rows {
  using Code = uint8_t;  // float8_e4m3fn bits
  static constexpr float kMaxCode = 448.f;
  static float value(Code c) { return kFp8Values[c]; }
  static float scale(const Code* row, int64_t D, int64_t g) { return group_scale(row, D, g); }
  // x already clamped to +-448: torch's own float -> float8_e4m3fn conversion (round to nearest even)
  static Code encode(float x) { return c10::Float8_e4m3fn(x).x; }
};

// Values per scale: kv_format.group_size (GROUP = 32, halved until it divides D).
inline int64_t group_size(int64_t D) {
  int64_t g = 32;
  while (D % g) g /= 2;
  return g;
}

// A row's D values in fp32: an fp32 row as it is, any other converted into `buffer` (D floats; in L1), each 8-bit
// group's codes dequantized in registers (value * scale: the values KVFormat.decode gives in fp32). A row is
// converted once for all the query heads that read it.
template <typename R>
__attribute__((always_inline)) inline const float* row_values(const typename R::Code* row, int64_t D, int64_t g,
                                                              float* buffer) {
  if constexpr (std::is_same_v<typename R::Code, float>) {
    return row;
  } else {
    for (int64_t start = 0, i = 0; start < D; start += g, ++i) {
      const float scale = R::scale(row, D, i);
#pragma omp simd
      for (int64_t d = start; d < start + g; ++d) buffer[d] = R::value(row[d]) * scale;
    }
    return buffer;
  }
}

// The pool as attend_group reads it: slot s's row of KV head h starts at codes + s * stride + h * width.
template <typename R>
struct Pool {
  const typename R::Code* k;
  const typename R::Code* v;
  int64_t stride;  // codes per slot: Hkv * width
  int64_t width;   // codes per row: D, or D + 2 * D / g for 8 bits
  int64_t g;       // values per scale (D in a plain pool)
};

// Per-thread scratch of attend_group: G query heads over up to max_len keys.
struct Scratch {
  std::vector<float> scores;  // [G, max_len]
  std::vector<float> q;       // [G, D]
  std::vector<float> out;     // [G, D]
  std::vector<float> totals;  // [G]
  std::vector<float> values;  // [D] one row's values
  Scratch(int64_t G, int64_t max_len, int64_t D) : scores(G * max_len), q(G * D), out(G * D), totals(G), values(D) {}
};

// The G query heads q [G, D] that share one KV head (GQA) against its context: out[G, D] = softmax(scale * q . K) V,
// in fp32 whatever the pool's format; each K and V row is read and converted once for the G heads.
// offset: the KV head's row within a slot (h * width).
template <typename R>
__attribute__((always_inline)) inline void attend_group(const Pool<R>& pool, const int64_t* ctx, int64_t len,
                                                        int64_t offset, int64_t G, int64_t D, float scale,
                                                        Scratch& s) {
  const typename R::Code* kc = pool.k + offset;
  const typename R::Code* vc = pool.v + offset;
  const float* q = s.q.data();
  float* scores = s.scores.data();  // [G, len]
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) prefetch_row(kc + ctx[j + kAhead] * pool.stride, pool.width);
    const float* k = row_values<R>(kc + ctx[j] * pool.stride, D, pool.g, s.values.data());
    for (int64_t h = 0; h < G; ++h) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q[h * D + d] * k[d];
      scores[h * len + j] = dot * scale;
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* row = scores + h * len;
    float top = -INFINITY;
    for (int64_t j = 0; j < len; ++j) top = std::max(top, row[j]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < len; ++j) {
      row[j] = exp_nonpositive(row[j] - top);
      total += row[j];
    }
    s.totals[h] = total;
  }
  float* out = s.out.data();
  for (int64_t i = 0; i < G * D; ++i) out[i] = 0.f;
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) prefetch_row(vc + ctx[j + kAhead] * pool.stride, pool.width);
    const float* v = row_values<R>(vc + ctx[j] * pool.stride, D, pool.g, s.values.data());
    for (int64_t h = 0; h < G; ++h) {
      const float w = scores[h * len + j] / s.totals[h];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[h * D + d] += w * v[d];
    }
  }
}


// ---- The wide loop: head_dim a multiple of 32, 16 values per vector (GCC's vector extensions: one zmm on AVX-512,
// two ymm on AVX2) ----
typedef float V16 __attribute__((vector_size(64)));
typedef int32_t V16i __attribute__((vector_size(64)));
typedef uint32_t V16u __attribute__((vector_size(64)));
typedef int8_t V16b __attribute__((vector_size(16)));
typedef uint8_t V16ub __attribute__((vector_size(16)));
typedef uint16_t V16h __attribute__((vector_size(32)));

// Values i * 16 .. i * 16 + 15 of a row, before its group's scale (the exact value of each code: an integer, an
// e4m3 value, a bf16 or fp32 value).
template <typename R>
__attribute__((always_inline)) inline V16 load16(const typename R::Code* row, int64_t i) {
  using Code = typename R::Code;
  if constexpr (std::is_same_v<Code, float>) {
    V16 x;
    std::memcpy(&x, row + i * 16, sizeof(x));
    return x;
  } else if constexpr (std::is_same_v<Code, c10::BFloat16>) {
    V16h h;
    std::memcpy(&h, row + i * 16, sizeof(h));
    return reinterpret_cast<V16>(__builtin_convertvector(h, V16u) << 16);
  } else {  // 8-bit codes as a loop GCC vectorizes (its __builtin_convertvector of int8 or uint8 lanes is scalar)
    const Code* codes = row + i * 16;
    float lanes[16];
    if constexpr (std::is_same_v<R, Int8Rows>) {  // code + 128 as the low bits of 2^23's mantissa, less 2^23 + 128
      for (int l = 0; l < 16; ++l) {
        const uint32_t bits = 0x4b000000u | (static_cast<uint8_t>(codes[l]) ^ 0x80u);
        float biased;
        std::memcpy(&biased, &bits, sizeof(biased));
        lanes[l] = biased - 8388736.f;
      }
    } else {  // float8_e4m3fn by shifts: its exponent and mantissa under fp32's, then times 2^(127 - 7) (exact; fp8's
              // subnormals are fp32 subnormals before it); the sign bit moved to fp32's
      for (int l = 0; l < 16; ++l) {
        const uint32_t bits = codes[l];
        float magnitude;
        const uint32_t shifted = (bits & 0x7fu) << 20;
        std::memcpy(&magnitude, &shifted, sizeof(magnitude));
        magnitude *= 1.329227995784915872903807060280344576e36f;
        uint32_t value;
        std::memcpy(&value, &magnitude, sizeof(value));
        value |= (bits & 0x80u) << 24;
        std::memcpy(lanes + l, &value, sizeof(value));
      }
    }
    V16 x;
    std::memcpy(&x, lanes, sizeof(x));
    return x;
  }
}

// 16 vectors [16 keys][16 partial sums] -> [16 keys' sums]: pairs of vectors folded in halves, 4 times.
__attribute__((always_inline)) inline V16 fold16(const V16* x) {
  V16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// An fp16 scale's value: a normal one (every scale an encoder writes) by shifts, any other by c10::Half.
__attribute__((always_inline)) inline float half_value(const void* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  const uint32_t exponent = h & 0x7c00u;
  if (exponent == 0 || exponent == 0x7c00u) return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  const uint32_t bits = ((h & 0x8000u) << 16) | (((h & 0x7fffu) << 13) + 0x38000000u);  // exponent bias 15 -> 127
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// A row's group scales, one per 2 vectors (groups of 32); 1 in a plain row.
template <typename R, int NV>
__attribute__((always_inline)) inline void group_scales(const typename R::Code* row, float* scales) {
  for (int gi = 0; gi < NV / 2; ++gi)
    scales[gi] = R::kMaxCode == 0.f ? 1.f : half_value(reinterpret_cast<const char*>(row + NV * 16) + 2 * gi);
}

// row[j] = exp(row[j] - max(row)) in place, for j < len; returns their sum in one order for a given len (key j
// into lane j % 16, then the lanes folded in halves), not the one a compiler's vectorized reduction picks.
__attribute__((always_inline)) inline float exp_and_sum(float* row, int64_t len) {
  float top = -INFINITY;
  for (int64_t j = 0; j < len; ++j) top = std::max(top, row[j]);
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) row[j] = exp_nonpositive(row[j] - top);
  V16 lanes{};
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    V16 x;
    std::memcpy(&x, row + j, sizeof(x));
    lanes += x;
  }
  float tail[16] = {};
  std::memcpy(tail, row + j, (len - j) * sizeof(float));
  V16 rest;
  std::memcpy(&rest, tail, sizeof(rest));
  lanes += rest;
  float sums[16];
  std::memcpy(sums, &lanes, sizeof(sums));
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) sums[i] += sums[i + width];
  return sums[0];
}

// The AVX-512 variants' target, both kernels' (each adds ",avx512bf16" for its bf16 pairs' variant).
#define KVREUSE_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"

// ---- Scores from bf16 pairs (AVX-512 BF16: a bf16 query over a bf16 pool) ----
// vdpbf16ps multiplies 32 bf16 pairs and adds each lane's two products to an fp32 lane: half the instructions of
// converting the key to fp32 and multiplying it, and no conversion. Its products are exact, as fp32's are (8-bit
// mantissas), but it adds in its own order (and flushes subnormals), so a CPU takes it for every row or for none: the
// decode and the prefill kernel pick it together (attend_dot). The instruction is written as inline assembly, which
// needs no target attribute on the inline functions on the way; only the variants built for it instantiate it.
typedef uint16_t Bf16Pairs __attribute__((vector_size(64)));  // 32 bf16 values, as bits

// 32 fp32 values that are bf16 values (a bf16 query, converted exactly) as 32 bf16s, value i in element i: each
// value's upper 16 bits.
__attribute__((always_inline)) inline Bf16Pairs bf16_pairs(V16 lo, V16 hi) {
  return __builtin_shufflevector(reinterpret_cast<Bf16Pairs>(lo), reinterpret_cast<Bf16Pairs>(hi), 1, 3, 5, 7, 9, 11,
                                 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53,
                                 55, 57, 59, 61, 63);
}

// values 32 * i .. 32 * i + 31 of a bf16 row
template <typename C>
__attribute__((always_inline)) inline Bf16Pairs load_pairs(const C* row, int i) {
  Bf16Pairs x;
  std::memcpy(&x, row + 32 * i, sizeof(x));
  return x;
}

// lane l: the sum over i of q[i]'s and k[i]'s pairs (2l, 2l + 1), accumulated in i's order
template <int N>
__attribute__((always_inline)) inline V16 dot_pairs(const Bf16Pairs* q, const Bf16Pairs* k) {
  V16 total{};
  for (int i = 0; i < N; ++i) asm("vdpbf16ps %2, %1, %0" : "+v"(total) : "v"(q[i]), "v"(k[i]));
  return total;
}

// attend_group for D = NV * 16 (groups of 32 in an 8-bit pool), query heads taken GC at a time (the outputs of GC
// heads stay in registers; a row is converted once per GC heads). The same numbers as attend_group up to summation
// order: a K group's dot is summed from code * q and then scaled, a V row's code * (weight * scale) summed.
template <typename R, int NV, int GC, bool kDot>
__attribute__((always_inline)) inline void attend_group_wide(const Pool<R>& pool, const int64_t* ctx, int64_t len,
                                                             int64_t offset, int64_t G, float scale, Scratch& s) {
  constexpr int64_t D = NV * 16;
  constexpr bool kScaled = R::kMaxCode != 0.f;
  const typename R::Code* kc = pool.k + offset;
  const typename R::Code* vc = pool.v + offset;
  float* scores = s.scores.data();  // [G, len]
  for (int64_t h0 = 0; h0 < G; h0 += GC) {
    const int64_t gc = std::min<int64_t>(GC, G - h0);
    V16 q[GC][NV];
    for (int h = 0; h < GC; ++h)
      for (int i = 0; i < NV; ++i)
        if (h < gc) std::memcpy(&q[h][i], s.q.data() + (h0 + h) * D + i * 16, sizeof(V16));
    [[maybe_unused]] Bf16Pairs qp[GC][NV / 2];
    if constexpr (kDot)
      for (int h = 0; h < GC; ++h)
        for (int gi = 0; gi < NV / 2; ++gi) qp[h][gi] = bf16_pairs(q[h][2 * gi], q[h][2 * gi + 1]);
    V16 partial[GC][16];
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - j0);
      for (int64_t jj = 0; jj < 16; ++jj) {
        if (jj >= n) {
          for (int h = 0; h < GC; ++h) partial[h][jj] = V16{};
          continue;
        }
        const int64_t j = j0 + jj;
        if (j + kAheadWide < len) prefetch_row(kc + ctx[j + kAheadWide] * pool.stride, pool.width);
        const typename R::Code* row = kc + ctx[j] * pool.stride;
        if constexpr (kDot) {
          Bf16Pairs x[NV / 2];
          for (int gi = 0; gi < NV / 2; ++gi) x[gi] = load_pairs(row, gi);
          for (int h = 0; h < GC; ++h) {
            if (h >= gc) break;
            partial[h][jj] = dot_pairs<NV / 2>(qp[h], x);
          }
          continue;
        }
        V16 x[NV];
        for (int i = 0; i < NV; ++i) x[i] = load16<R>(row, i);
        float gs[NV / 2];
        group_scales<R, NV>(row, gs);
        for (int h = 0; h < GC; ++h) {
          if (h >= gc) break;
          V16 total{};
          for (int gi = 0; gi < NV / 2; ++gi) {
            const V16 dot = q[h][2 * gi] * x[2 * gi] + q[h][2 * gi + 1] * x[2 * gi + 1];
            total = kScaled ? total + dot * gs[gi] : total + dot;
          }
          partial[h][jj] = total;
        }
      }
      for (int h = 0; h < GC; ++h) {
        if (h >= gc) break;
        const V16 sums = fold16(partial[h]) * scale;
        float* to = scores + (h0 + h) * len + j0;
        if (n == 16) {
          std::memcpy(to, &sums, sizeof(sums));
        } else {
          float lanes[16];
          std::memcpy(lanes, &sums, sizeof(lanes));
          for (int64_t jj = 0; jj < n; ++jj) to[jj] = lanes[jj];
        }
      }
    }
  }
  for (int64_t h = 0; h < G; ++h) s.totals[h] = exp_and_sum(scores + h * len, len);
  for (int64_t h0 = 0; h0 < G; h0 += GC) {
    const int64_t gc = std::min<int64_t>(GC, G - h0);
    V16 acc[GC][NV];
    for (int h = 0; h < GC; ++h)
      for (int i = 0; i < NV; ++i) acc[h][i] = V16{};
    for (int64_t j = 0; j < len; ++j) {
      if (j + kAheadWide < len) prefetch_row(vc + ctx[j + kAheadWide] * pool.stride, pool.width);
      const typename R::Code* row = vc + ctx[j] * pool.stride;
      V16 x[NV];
      for (int i = 0; i < NV; ++i) x[i] = load16<R>(row, i);
      float gs[NV / 2];
      group_scales<R, NV>(row, gs);
      for (int h = 0; h < GC; ++h) {
        if (h >= gc) break;
        const float p = scores[(h0 + h) * len + j];
        for (int gi = 0; gi < NV / 2; ++gi) {
          const float w = kScaled ? p * gs[gi] : p;
          acc[h][2 * gi] += w * x[2 * gi];
          acc[h][2 * gi + 1] += w * x[2 * gi + 1];
        }
      }
    }
    for (int h = 0; h < GC; ++h) {
      if (h >= gc) break;
      const float inverse = 1.f / s.totals[h0 + h];
      for (int i = 0; i < NV; ++i) {
        const V16 o = acc[h][i] * inverse;
        std::memcpy(s.out.data() + (h0 + h) * D + i * 16, &o, sizeof(V16));
      }
    }
  }
}


// One query row's G query heads q [G, D] (in T) over the `len` keys at pool slots ctx[0 .. len) of the KV head
// whose rows start at `offset` within a slot: out [G, D] (in T). Every kernel computes a row through this, so a row's
// numbers depend on its query and keys only.
template <typename T, typename R, bool kDot = false>
__attribute__((always_inline)) inline void attend_row(const T* q, const Pool<R>& pool, const int64_t* ctx,
                                                      int64_t len, int64_t offset, int64_t G, int64_t D, float scale,
                                                      T* out, Scratch& s) {
  for (int64_t e = 0; e < G * D; ++e) s.q[e] = static_cast<float>(q[e]);
  if (D == 64) attend_group_wide<R, 4, 4, kDot>(pool, ctx, len, offset, G, scale, s);
  else if (D == 128) attend_group_wide<R, 8, 2, kDot>(pool, ctx, len, offset, G, scale, s);
  else if (D == 256) attend_group_wide<R, 16, 1, kDot>(pool, ctx, len, offset, G, scale, s);
  else attend_group<R>(pool, ctx, len, offset, G, D, scale, s);
  for (int64_t e = 0; e < G * D; ++e) out[e] = static_cast<T>(s.out[e]);
}

// The widest variant this CPU and torch's dispatch allow.
inline kvreuse::Isa attend_isa() {
  using kvreuse::Isa;
  static const Isa isa = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const char* env = std::getenv("ATEN_CPU_CAPABILITY");  // torch's own setting, read as torch reads it
    const std::string capability = env ? env : "";
    const Isa allowed = capability == "avx2" ? Isa::kAvx2 : capability == "default" ? Isa::kNone : Isa::kAvx512;
    return std::min(avx512 ? Isa::kAvx512 : avx2 ? Isa::kAvx2 : Isa::kNone, allowed);
  }();
  return isa;
}

// Whether a bf16 query over a bf16 pool takes the bf16 dot products (AVX-512 BF16) in both kernels: where the CPU has
// them, unless KVREUSE_BF16_DOT=0 (the fp32 products every other CPU computes).
inline bool attend_dot() {
  static const bool dot = [] {
    const char* env = std::getenv("KVREUSE_BF16_DOT");
    return attend_isa() == kvreuse::Isa::kAvx512 && __builtin_cpu_supports("avx512bf16") &&
           !(env && std::string(env) == "0");
  }();
  return dot;
}


}  // namespace kvreuse_attention
