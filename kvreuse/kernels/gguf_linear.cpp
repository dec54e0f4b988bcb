// y = x @ W.T for x of any row count, with W kept in quantized blocks of 32 inputs, each with
// one scale and min per group of 32 or 16 inputs (g = j / group):
//   W[n, b*32 + j] = scales[n, b, g] * code(n, b, j) + mins[n, b, g]
// codes are 4-bit (Q4_0/Q4_1/Q4_K) or 8-bit (Q5_0/Q8_0, and Q6_K's 6-bit codes, with groups of 16). The weights
// are dequantized in registers, in fp32, with the very expression the fp32 path dequantizes with (scale * code +
// min, exact for every GGUF format mapped here), and multiplied by fp32 activations with fp32 accumulation: the
// fp32 path's product up to summation order, and one summation order for every row whatever the row count.
//
// The layout (gguf_blocks.py packs it): for each panel of 16 output rows, for each block of 32 inputs, one record of
//   G x 16 scales, G x 16 mins (fp16 where every one is an fp16 number, else fp32; G = 32 / group), then the codes
//   as vectors across the panel's rows: 4-bit: 16 x 16 bytes, byte r of vector j holding row r's inputs j (low
//   nibble) and j + 16 (high); 8-bit: 32 x 16 bytes, vector j holding row r's input j.
// A vector of 16 codes dequantizes into the weights of 16 output rows at one input, which then multiply a broadcast
// input of every row of x (an outer product): a dequantized weight serves up to 16 rows of x, and no sum is reduced
// across lanes. One thread streams its panels' records from one place in memory.
//
// One source, compiled once for the baseline x86-64 target: the AVX-512 and AVX2 variants carry their own target
// attributes and `best_isa()` says which one this CPU runs (0: neither; the caller then dequantizes in torch).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPanel = 16;  // output rows per record (gguf_blocks.PANEL_ROWS)
using kvreuse::Isa;

struct Problem {
  const float* x;         // [T, K]
  const uint8_t* packed;  // [ceil(N / 16), K / 32, record bytes]
  float* y;               // [T, N]
  int64_t T, N, K;
};

// G: groups (scale and min pairs) per block and row: 1, or 2 for groups of 16 inputs.
constexpr int64_t record_bytes(int64_t bits, int64_t groups, bool half) {
  return kPanel * (2 * groups * (half ? 2 : 4) + bits * kBlock / 8);
}

#if defined(__x86_64__)

// Every row of x takes one summation order whatever the row count T, so that a row's output never depends on what
// else is in its batch (prefix reuse computes a prompt's rows after a cached prefix, a cold run computes them all in
// one product; docs/design/batch-invariance.md): two sums per output, one over inputs 0-15 of every block and one
// over inputs 16-31, each in input order, added at the end. Few rows dequantize in registers; more rows dequantize
// the panel once into a buffer [K, 16] that tiles of rows read in the same order.

// ---- AVX-512: a panel's 16 rows are one vector ----

constexpr int kPassRows512 = 8;   // rows that dequantize in registers at once (2 x 8 accumulators)
constexpr int kRegisterRows512 = 16;  // rows that take passes in registers, not the dequantized panel
constexpr int kTileRows512 = 12;  // rows per tile over a dequantized panel (2 x 12 accumulators of 32 registers)

template <bool Half>
__attribute__((target("avx512f,f16c"))) inline __m512 scales512(const uint8_t* p, int i) {
  if constexpr (Half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + i));
  else return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + kPanel * i);
}

// A block's scales and mins for inputs 0-15 (d0, m0) and 16-31 (d1, m1), across a panel's 16 rows.
struct Scales512 {
  __m512 d0, m0, d1, m1;
};

template <int G, bool Half>
__attribute__((target("avx512f,f16c"))) inline Scales512 block_scales512(const uint8_t* record) {
  const __m512 d0 = scales512<Half>(record, 0), m0 = scales512<Half>(record, G);
  return {d0, m0, G == 1 ? d0 : scales512<Half>(record, 1), G == 1 ? m0 : scales512<Half>(record, G + 1)};
}

// The weights of a panel's 16 rows at inputs j (lo) and j + 16 (hi) of the block at `record`.
template <int Bits, int G, bool Half>
__attribute__((target("avx512f,fma,avx2,f16c"))) inline void weights512(const uint8_t* record, const Scales512& s,
                                                                       int j, __m512& lo, __m512& hi) {
  const auto [d0, m0, d1, m1] = s;
  const uint8_t* codes = record + 2 * G * kPanel * (Half ? 2 : 4);
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * j)));
  if constexpr (Bits == 4) {
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), d0, m0);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d1, m1);
  } else {
    const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * (j + 16))));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d0, m0);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d1, m1);
  }
}

template <int TR>
__attribute__((target("avx512f"))) inline void store512(const Problem& p, int64_t panel, int64_t t0,
                                                        const __m512 (&acc)[2][TR]) {
  const int64_t n0 = panel * kPanel, valid = std::min(kPanel, p.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int t = 0; t < TR; ++t) _mm512_mask_storeu_ps(p.y + (t0 + t) * p.N + n0, mask, _mm512_add_ps(acc[0][t], acc[1][t]));
}

// One panel against TR rows of x from t0, dequantizing in registers.
template <int Bits, int G, bool Half, int TR>
__attribute__((target("avx512f,fma,avx2,f16c"))) void panel512(const Problem& p, int64_t panel, int64_t t0) {
  constexpr int64_t kRecord = record_bytes(Bits, G, Half);
  const int64_t num_blocks = p.K / kBlock;
  const uint8_t* record = p.packed + panel * num_blocks * kRecord;
  const float* x = p.x + t0 * p.K;
  __m512 acc[2][TR];
  for (int t = 0; t < TR; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b, record += kRecord) {
    for (int64_t line = 0; line < kRecord; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + 4 * kRecord + line), _MM_HINT_T0);
    const float* xb = x + b * kBlock;
    const Scales512 scales = block_scales512<G, Half>(record);
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
      __m512 lo, hi;
      weights512<Bits, G, Half>(record, scales, j, lo, hi);
      for (int t = 0; t < TR; ++t) {
        acc[0][t] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[t * p.K + j]), acc[0][t]);
        acc[1][t] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[t * p.K + j + 16]), acc[1][t]);
      }
    }
  }
  store512<TR>(p, panel, t0, acc);
}

// The panel's weights, dequantized once: w[k * 16 + r] is W[panel * 16 + r, k].
template <int Bits, int G, bool Half>
__attribute__((target("avx512f,fma,avx2,f16c"))) void dequantize512(const Problem& p, int64_t panel, float* w) {
  constexpr int64_t kRecord = record_bytes(Bits, G, Half);
  const uint8_t* record = p.packed + panel * (p.K / kBlock) * kRecord;
  for (int64_t b = 0; b < p.K / kBlock; ++b, record += kRecord, w += kBlock * kPanel) {
    const Scales512 scales = block_scales512<G, Half>(record);
    for (int j = 0; j < 16; ++j) {
      __m512 lo, hi;
      weights512<Bits, G, Half>(record, scales, j, lo, hi);
      _mm512_storeu_ps(w + kPanel * j, lo);
      _mm512_storeu_ps(w + kPanel * (j + 16), hi);
    }
  }
}

// TR rows of x from t0 against a dequantized panel, in panel512's order.
template <int TR>
__attribute__((target("avx512f,fma"))) void buffered512(const Problem& p, const float* w, int64_t panel, int64_t t0) {
  const float* x = p.x + t0 * p.K;
  __m512 acc[2][TR];
  for (int t = 0; t < TR; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K; k += kBlock) {
#pragma GCC unroll 2
    for (int64_t j = k; j < k + 16; ++j) {
      const __m512 w0 = _mm512_loadu_ps(w + kPanel * j), w1 = _mm512_loadu_ps(w + kPanel * (j + 16));
      for (int t = 0; t < TR; ++t) {
        acc[0][t] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[t * p.K + j]), acc[0][t]);
        acc[1][t] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[t * p.K + j + 16]), acc[1][t]);
      }
    }
  }
  store512<TR>(p, panel, t0, acc);
}

// ---- AVX2: a panel's 16 rows are two 8-lane halves, each its own pass (16 registers) ----

constexpr int kPassRows256 = 4;  // rows that dequantize in registers at once (2 x 4 accumulators)
constexpr int kRegisterRows256 = 8;  // rows that take passes in registers, not the dequantized panel
constexpr int kTileRows256 = 5;  // rows per tile over a dequantized panel (2 x 5 accumulators of 16 registers)

template <bool Half>
__attribute__((target("avx2,f16c"))) inline __m256 scales256(const uint8_t* p, int i, int half) {
  if constexpr (Half)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * (kPanel * i + 8 * half))));
  else return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + kPanel * i + 8 * half);
}

struct Scales256 {
  __m256 d0, m0, d1, m1;
};

template <int G, bool Half>
__attribute__((target("avx2,f16c"))) inline Scales256 block_scales256(const uint8_t* record, int half) {
  const __m256 d0 = scales256<Half>(record, 0, half), m0 = scales256<Half>(record, G, half);
  return {d0, m0, G == 1 ? d0 : scales256<Half>(record, 1, half), G == 1 ? m0 : scales256<Half>(record, G + 1, half)};
}

// The weights of a panel's 8 rows of `half` at inputs j (lo) and j + 16 (hi) of the block at `record`.
template <int Bits, int G, bool Half>
__attribute__((target("avx2,fma,f16c"))) inline void weights256(const uint8_t* record, const Scales256& s, int j,
                                                               int half, __m256& lo, __m256& hi) {
  const auto [d0, m0, d1, m1] = s;
  const uint8_t* codes = record + 2 * G * kPanel * (Half ? 2 : 4) + 8 * half;
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 16 * j)));
  if constexpr (Bits == 4) {
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15))), d0, m0);
    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d1, m1);
  } else {
    const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 16 * (j + 16))));
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d0, m0);
    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), d1, m1);
  }
}

template <int TR>
__attribute__((target("avx2"))) inline void store256(const Problem& p, int64_t panel, int64_t t0, int half,
                                                     const __m256 (&acc)[2][TR]) {
  const int64_t n0 = panel * kPanel + 8 * half, valid = std::min<int64_t>(8, p.N - n0);
  for (int t = 0; t < TR; ++t) {
    const __m256 v = _mm256_add_ps(acc[0][t], acc[1][t]);
    float* out = p.y + (t0 + t) * p.N + n0;
    if (valid == 8) {
      _mm256_storeu_ps(out, v);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, v);
      std::copy(lanes, lanes + valid, out);
    }
  }
}

template <int Bits, int G, bool Half, int TR>
__attribute__((target("avx2,fma,f16c"))) void panel256(const Problem& p, int64_t panel, int64_t t0, int half) {
  constexpr int64_t kRecord = record_bytes(Bits, G, Half);
  const int64_t num_blocks = p.K / kBlock;
  if (panel * kPanel + 8 * half >= p.N) return;
  const uint8_t* record = p.packed + panel * num_blocks * kRecord;
  const float* x = p.x + t0 * p.K;
  __m256 acc[2][TR];
  for (int t = 0; t < TR; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b, record += kRecord) {
    for (int64_t line = 0; line < kRecord; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + 4 * kRecord + line), _MM_HINT_T0);
    const float* xb = x + b * kBlock;
    const Scales256 scales = block_scales256<G, Half>(record, half);
#pragma GCC unroll 2
    for (int j = 0; j < 16; ++j) {
      __m256 lo, hi;
      weights256<Bits, G, Half>(record, scales, j, half, lo, hi);
      for (int t = 0; t < TR; ++t) {
        acc[0][t] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xb + t * p.K + j), acc[0][t]);
        acc[1][t] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xb + t * p.K + j + 16), acc[1][t]);
      }
    }
  }
  store256<TR>(p, panel, t0, half, acc);
}

template <int Bits, int G, bool Half>
__attribute__((target("avx2,fma,f16c"))) void dequantize256(const Problem& p, int64_t panel, float* w) {
  constexpr int64_t kRecord = record_bytes(Bits, G, Half);
  const uint8_t* record = p.packed + panel * (p.K / kBlock) * kRecord;
  for (int64_t b = 0; b < p.K / kBlock; ++b, record += kRecord, w += kBlock * kPanel) {
    for (int half = 0; half < 2; ++half) {
      const Scales256 scales = block_scales256<G, Half>(record, half);
      for (int j = 0; j < 16; ++j) {
        __m256 lo, hi;
        weights256<Bits, G, Half>(record, scales, j, half, lo, hi);
        _mm256_storeu_ps(w + kPanel * j + 8 * half, lo);
        _mm256_storeu_ps(w + kPanel * (j + 16) + 8 * half, hi);
      }
    }
  }
}

template <int TR>
__attribute__((target("avx2,fma"))) void buffered256(const Problem& p, const float* w, int64_t panel, int64_t t0,
                                                     int half) {
  if (panel * kPanel + 8 * half >= p.N) return;
  const float* x = p.x + t0 * p.K;
  __m256 acc[2][TR];
  for (int t = 0; t < TR; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
  w += 8 * half;
  for (int64_t k = 0; k < p.K; k += kBlock) {
    for (int64_t j = k; j < k + 16; ++j) {
      const __m256 w0 = _mm256_loadu_ps(w + kPanel * j), w1 = _mm256_loadu_ps(w + kPanel * (j + 16));
      for (int t = 0; t < TR; ++t) {
        acc[0][t] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + t * p.K + j), acc[0][t]);
        acc[1][t] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + t * p.K + j + 16), acc[1][t]);
      }
    }
  }
  store256<TR>(p, panel, t0, half, acc);
}

// Up to kRegisterRows rows of x take passes of kPassRows rows, which dequantize in registers (one instance per row
// count, so that the accumulators stay in registers). More rows take tiles of kTileRows, then fewer, over the panel
// dequantized once.
template <int Bits, int G, bool Half, int... I>
void one_pass512(const Problem& p, int64_t panel, int64_t t0, std::integer_sequence<int, I...>) {
  const int64_t rows = std::min<int64_t>(kPassRows512, p.T - t0);
  ((rows == I + 1 ? panel512<Bits, G, Half, I + 1>(p, panel, t0) : void()), ...);
}

template <int... I>
void rest512(const Problem& p, const float* w, int64_t panel, int64_t t0, std::integer_sequence<int, I...>) {
  ((p.T - t0 == I + 1 ? buffered512<I + 1>(p, w, panel, t0) : void()), ...);
}

template <int Bits, int G, bool Half, int... I>
void one_pass256(const Problem& p, int64_t panel, int64_t t0, int half, std::integer_sequence<int, I...>) {
  const int64_t rows = std::min<int64_t>(kPassRows256, p.T - t0);
  ((rows == I + 1 ? panel256<Bits, G, Half, I + 1>(p, panel, t0, half) : void()), ...);
}

template <int... I>
void rest256(const Problem& p, const float* w, int64_t panel, int64_t t0, int half, std::integer_sequence<int, I...>) {
  ((p.T - t0 == I + 1 ? buffered256<I + 1>(p, w, panel, t0, half) : void()), ...);
}

template <int Bits, int G, bool Half>
void panel_rows512(const Problem& p, int64_t panel, float* w) {
  if (p.T <= kRegisterRows512) {
    for (int64_t t0 = 0; t0 < p.T; t0 += kPassRows512)
      one_pass512<Bits, G, Half>(p, panel, t0, std::make_integer_sequence<int, kPassRows512>{});
    return;
  }
  dequantize512<Bits, G, Half>(p, panel, w);
  int64_t t0 = 0;
  for (; t0 + kTileRows512 <= p.T; t0 += kTileRows512) buffered512<kTileRows512>(p, w, panel, t0);
  rest512(p, w, panel, t0, std::make_integer_sequence<int, kTileRows512 - 1>{});
}

template <int Bits, int G, bool Half>
void panel_rows256(const Problem& p, int64_t panel, float* w) {
  if (p.T <= kRegisterRows256) {
    for (int half = 0; half < 2; ++half)
      for (int64_t t0 = 0; t0 < p.T; t0 += kPassRows256)
        one_pass256<Bits, G, Half>(p, panel, t0, half, std::make_integer_sequence<int, kPassRows256>{});
    return;
  }
  dequantize256<Bits, G, Half>(p, panel, w);
  for (int half = 0; half < 2; ++half) {
    int64_t t0 = 0;
    for (; t0 + kTileRows256 <= p.T; t0 += kTileRows256) buffered256<kTileRows256>(p, w, panel, t0, half);
    rest256(p, w, panel, t0, half, std::make_integer_sequence<int, kTileRows256 - 1>{});
  }
}

template <int Bits, int G, bool Half>
void run(const Problem& p, Isa isa) {
  const int64_t num_panels = (p.N + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> w(p.T > kRegisterRows256 ? p.K * kPanel : 0);  // the dequantized panel, when tiles read it
    for (int64_t panel = begin; panel < end; ++panel) {
      if (isa == Isa::kAvx512) panel_rows512<Bits, G, Half>(p, panel, w.data());
      else panel_rows256<Bits, G, Half>(p, panel, w.data());
    }
  });
}

template <bool Half>
void dispatch(const Problem& p, int64_t bits, int64_t group, Isa isa) {
  if (bits == 4) run<4, 1, Half>(p, isa);
  else if (group == 32) run<8, 1, Half>(p, isa);
  else run<8, 2, Half>(p, isa);
}

#endif  // __x86_64__

int64_t best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f")) return static_cast<int64_t>(Isa::kAvx512);
  if (avx2) return static_cast<int64_t>(Isa::kAvx2);
#endif
  return static_cast<int64_t>(Isa::kNone);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t bits, int64_t group,
                  bool half_scales, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [T, K] fp32, contiguous");
  TORCH_CHECK((bits == 4 && group == 32) || (bits == 8 && (group == 32 || group == 16)),
              "bits and group must be 4 and 32, or 8 and 32 or 16 (got ", bits, " and ", group, ")");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  const int64_t record = record_bytes(bits, kBlock / group, half_scales);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == (N + kPanel - 1) / kPanel * (K / kBlock) * record,
              "packed must hold ceil(N / 16) * K / 32 records of ", record, " bytes");
  TORCH_CHECK(isa == static_cast<int64_t>(Isa::kAvx2) || isa == static_cast<int64_t>(Isa::kAvx512),
              "isa must be 1 (AVX2) or 2 (AVX-512)");
  TORCH_CHECK(isa <= best_isa(), "this CPU does not run isa ", isa);
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  Problem p{x.data_ptr<float>(), packed.data_ptr<uint8_t>(), y.data_ptr<float>(), T, N, K};
#if defined(__x86_64__)
  if (half_scales) dispatch<true>(p, bits, group, static_cast<Isa>(isa));
  else dispatch<false>(p, bits, group, static_cast<Isa>(isa));
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvreuse_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor packed, int N, int bits, int group, bool half_scales, int isa) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) { m.impl("gguf_linear", &linear); }
