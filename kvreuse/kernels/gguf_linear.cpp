// y = x @ W.T for decode-shaped x (a few rows), with W kept in quantized blocks of 32 inputs:
//   W[n, b*32 + j] = scales[n, b] * code(n, b, j) + mins[n, b]
// codes are 4-bit (16 bytes per block: the low nibbles are inputs 0..15, the high ones 16..31, as in ggml's
// Q4_0/Q4_1/Q4_K) or 8-bit (32 bytes per block). The weights are dequantized in registers, in fp32, with the very
// expression the fp32 path dequantizes with (scale * code + min, exact for every GGUF format mapped here), and
// multiplied by fp32 activations with fp32 accumulation: the fp32 path's product up to summation order.
//
// One source, compiled once for the baseline x86-64 target: the AVX-512 and AVX2 variants carry their own target
// attributes and `best_isa()` says which one this CPU runs (0: neither; the caller then dequantizes in torch).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int kIsaNone = 0, kIsaAvx2 = 1, kIsaAvx512 = 2;

struct Problem {
  const float* x;        // [T, K]
  const uint8_t* codes;  // [N, K / 32, 16 or 32]
  const float* scales;   // [N, K / 32]
  const float* mins;     // [N, K / 32]
  float* y;              // [T, N]
  int64_t T, N, K;
};

#if defined(__x86_64__)

// ---- AVX-512: one block is two 16-lane vectors ----

template <int Bits>
__attribute__((target("avx512f,fma"))) inline void dequant512(const uint8_t* c, __m512 d, __m512 m, __m512& lo,
                                                               __m512& hi) {
  if constexpr (Bits == 4) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));  // 16 bytes
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
  } else {
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                             reinterpret_cast<const __m128i*>(c)))), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                             reinterpret_cast<const __m128i*>(c + 16)))), d, m);
  }
}

// NR output rows from n0, TR input rows from t0.
template <int Bits, int NR, int TR>
__attribute__((target("avx512f,fma"))) void tile512(const Problem& p, int64_t n0, int64_t t0) {
  constexpr int64_t kBlockBytes = Bits * kBlock / 8;
  const int64_t num_blocks = p.K / kBlock;
  __m512 acc[NR][TR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512 xlo[TR], xhi[TR];
    for (int t = 0; t < TR; ++t) {
      const float* xb = p.x + (t0 + t) * p.K + b * kBlock;
      xlo[t] = _mm512_loadu_ps(xb);
      xhi[t] = _mm512_loadu_ps(xb + 16);
    }
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r;
      __m512 lo, hi;
      dequant512<Bits>(p.codes + (n * num_blocks + b) * kBlockBytes, _mm512_set1_ps(p.scales[n * num_blocks + b]),
                       _mm512_set1_ps(p.mins[n * num_blocks + b]), lo, hi);
      for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_fmadd_ps(hi, xhi[t], _mm512_fmadd_ps(lo, xlo[t], acc[r][t]));
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TR; ++t) p.y[(t0 + t) * p.N + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// ---- AVX2: one block is four 8-lane vectors ----

template <int Bits>
__attribute__((target("avx2,fma"))) inline void dequant256(const uint8_t* c, __m256 d, __m256 m, __m256 w[4]) {
  if constexpr (Bits == 4) {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    __m256i q0 = _mm256_cvtepu8_epi32(bytes), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    __m256i low = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), d, m);
  } else {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                 reinterpret_cast<const __m128i*>(c + 8 * i)))), d, m);
  }
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int Bits, int NR, int TR>
__attribute__((target("avx2,fma"))) void tile256(const Problem& p, int64_t n0, int64_t t0) {
  constexpr int64_t kBlockBytes = Bits * kBlock / 8;
  const int64_t num_blocks = p.K / kBlock;
  __m256 acc[NR][TR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TR; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r;
      __m256 w[4];
      dequant256<Bits>(p.codes + (n * num_blocks + b) * kBlockBytes, _mm256_set1_ps(p.scales[n * num_blocks + b]),
                       _mm256_set1_ps(p.mins[n * num_blocks + b]), w);
      for (int t = 0; t < TR; ++t) {
        const float* xb = p.x + (t0 + t) * p.K + b * kBlock;
        __m256 a = acc[r][t];
        for (int i = 0; i < 4; ++i) a = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), a);
        acc[r][t] = a;
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TR; ++t) p.y[(t0 + t) * p.N + n0 + r] = hsum256(acc[r][t]);
}

// Row tiles: TR input rows at a time (4, then the 1..3 left), NR output rows (the N % NR left one at a time).
template <int Bits, int NR, int TR, bool Wide>
void tile(const Problem& p, int64_t n0, int64_t t0) {
  if constexpr (Wide) tile512<Bits, NR, TR>(p, n0, t0);
  else tile256<Bits, NR, TR>(p, n0, t0);
}

template <int Bits, int NR, bool Wide>
void rows(const Problem& p, int64_t n0) {
  int64_t t0 = 0;
  for (; t0 + 4 <= p.T; t0 += 4) tile<Bits, NR, 4, Wide>(p, n0, t0);
  switch (p.T - t0) {
    case 3: tile<Bits, NR, 3, Wide>(p, n0, t0); break;
    case 2: tile<Bits, NR, 2, Wide>(p, n0, t0); break;
    case 1: tile<Bits, NR, 1, Wide>(p, n0, t0); break;
    default: break;
  }
}

template <int Bits, bool Wide>
void run(const Problem& p) {
  constexpr int64_t kNR = Wide ? 4 : 2;
  const int64_t num_tiles = (p.N + kNR - 1) / kNR;
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * kNR;
      if (n0 + kNR <= p.N) {
        rows<Bits, kNR, Wide>(p, n0);
      } else {
        for (int64_t n = n0; n < p.N; ++n) rows<Bits, 1, Wide>(p, n);
      }
    }
  });
}

#endif  // __x86_64__

int64_t best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return kIsaAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kIsaAvx2;
#endif
  return kIsaNone;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                  int64_t bits, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [T, K] fp32, contiguous");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  mins.sizes() == scales.sizes() && mins.scalar_type() == at::kFloat && mins.is_contiguous(),
              "scales and mins must be [N, K / 32] fp32, contiguous");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t T = x.size(0), K = x.size(1), N = scales.size(0);
  TORCH_CHECK(K % kBlock == 0 && scales.size(1) == K / kBlock, "K must be 32 * scales.size(1)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == N * K * bits / 8,
              "codes must be N * K * bits / 8 uint8, contiguous");
  TORCH_CHECK(isa == kIsaAvx2 || isa == kIsaAvx512, "isa must be 1 (AVX2) or 2 (AVX-512)");
  TORCH_CHECK(isa <= best_isa(), "this CPU does not run isa ", isa);
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  Problem p{x.data_ptr<float>(), codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
            y.data_ptr<float>(), T, N, K};
#if defined(__x86_64__)
  if (isa == kIsaAvx512) bits == 4 ? run<4, true>(p) : run<8, true>(p);
  else bits == 4 ? run<4, false>(p) : run<8, false>(p);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(kvreuse_gguf, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits, int isa) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(kvreuse_gguf, CPU, m) { m.impl("linear", &linear); }
