// y = x @ W.T for decode-shaped x (a few rows), with W kept in quantized blocks of 32 inputs, each with one scale
// and min per group of 32 or 16 inputs (g = j / group):
//   W[n, b*32 + j] = scales[n, b, g] * code(n, b, j) + mins[n, b, g]
// codes are 4-bit (16 bytes per block: the low nibbles are inputs 0..15, the high ones 16..31, as in ggml's
// Q4_0/Q4_1/Q4_K) or 8-bit (32 bytes per block; Q6_K's 6-bit codes, with groups of 16). The weights are dequantized in registers, in fp32, with the very
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
constexpr int64_t kTileRows = 4;  // output rows whose blocks are stored together (the packing, gguf_blocks.py)
constexpr int kIsaNone = 0, kIsaAvx2 = 1, kIsaAvx512 = 2;

// The packed weight: for each tile of 4 output rows, for each block of 32 inputs, one record of
//   4 x G scales, 4 x G mins (fp32; G = 32 / group, row-major), then 4 x (16 or 32) code bytes,
// so that one thread streams its rows' weights from one place in memory. The scales are fp32 even where the file's
// are fp16: converting them in the loop cost more than the bytes they save (docs/design/performance.md).
struct Problem {
  const float* x;         // [T, K]
  const uint8_t* packed;  // [ceil(N / 4), K / 32, record bytes]
  float* y;               // [T, N]
  int64_t T, N, K;
};

// G: groups (scale and min pairs) per block and row: 1, or 2 for groups of 16 inputs.
constexpr int64_t record_bytes(int64_t bits, int64_t groups) {
  return kTileRows * (2 * 4 * groups + bits * kBlock / 8);
}

#if defined(__x86_64__)

inline float scale_at(const uint8_t* p, int i) {
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

// ---- AVX-512: one block is two 16-lane vectors ----

// One block of one row: inputs 0..15 in lo, 16..31 in hi, with (d0, m0) and, for two groups, (d1, m1) for hi.
// 4-bit codes take their weights from a table of the 16 values scale * code + min (the same fma as per lane, so
// the same bits): one fma per block instead of two, and no masking (vpermps reads only an index's low 4 bits).
template <int Bits>
__attribute__((target("avx512f,fma"))) inline void dequant512(const uint8_t* c, __m512 d0, __m512 m0, __m512 d1,
                                                               __m512 m1, __m512 iota, __m512& lo, __m512& hi) {
  if constexpr (Bits == 4) {
    const __m512 table = _mm512_fmadd_ps(iota, d0, m0);                                        // [16] weights
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));  // 16 bytes
    lo = _mm512_permutexvar_ps(q, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  } else {
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                             reinterpret_cast<const __m128i*>(c)))), d0, m0);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                             reinterpret_cast<const __m128i*>(c + 16)))), d1, m1);
  }
}

// One tile of 4 output rows against TR input rows from t0.
template <int Bits, int G, int TR>
__attribute__((target("avx512f,fma,avx2"))) void tile512(const Problem& p, int64_t tile, int64_t t0) {
  constexpr int64_t kRecord = record_bytes(Bits, G), kCodes = Bits * kBlock / 8;
  constexpr int64_t kScales = kTileRows * G * 4;
  const int64_t num_blocks = p.K / kBlock;
  const uint8_t* record = p.packed + tile * num_blocks * kRecord;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[kTileRows][TR];
  for (int r = 0; r < kTileRows; ++r)
    for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b, record += kRecord) {
    _mm_prefetch(reinterpret_cast<const char*>(record + 8 * kRecord), _MM_HINT_T0);
    __m512 xlo[TR], xhi[TR];
    for (int t = 0; t < TR; ++t) {
      const float* xb = p.x + (t0 + t) * p.K + b * kBlock;
      xlo[t] = _mm512_loadu_ps(xb);
      xhi[t] = _mm512_loadu_ps(xb + 16);
    }
    for (int r = 0; r < kTileRows; ++r) {
      __m512 lo, hi;
      const __m512 d0 = _mm512_set1_ps(scale_at(record, r * G)), m0 = _mm512_set1_ps(scale_at(record + kScales, r * G));
      const __m512 d1 = G == 1 ? d0 : _mm512_set1_ps(scale_at(record, r * G + 1));
      const __m512 m1 = G == 1 ? m0 : _mm512_set1_ps(scale_at(record + kScales, r * G + 1));
      dequant512<Bits>(record + 2 * kScales + r * kCodes, d0, m0, d1, m1, iota, lo, hi);
      for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_fmadd_ps(hi, xhi[t], _mm512_fmadd_ps(lo, xlo[t], acc[r][t]));
    }
  }
  for (int r = 0; r < kTileRows && tile * kTileRows + r < p.N; ++r)
    for (int t = 0; t < TR; ++t) p.y[(t0 + t) * p.N + tile * kTileRows + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// ---- AVX2: one block is four 8-lane vectors ----

// One block of one row as four 8-lane vectors: w[0..1] are inputs 0..15 (group 0), w[2..3] 16..31 (group G - 1).
template <int Bits>
__attribute__((target("avx2,fma"))) inline void dequant256(const uint8_t* c, __m256 d0, __m256 m0, __m256 d1,
                                                            __m256 m1, __m256 w[4]) {
  if constexpr (Bits == 4) {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    __m256i q0 = _mm256_cvtepu8_epi32(bytes), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    __m256i low = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), d0, m0);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), d0, m0);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), d1, m1);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), d1, m1);
  } else {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                 reinterpret_cast<const __m128i*>(c + 8 * i)))), i < 2 ? d0 : d1, i < 2 ? m0 : m1);
  }
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int Bits, int G, int TR>
__attribute__((target("avx2,fma"))) void tile256(const Problem& p, int64_t tile, int64_t t0) {
  constexpr int64_t kRecord = record_bytes(Bits, G), kCodes = Bits * kBlock / 8;
  constexpr int64_t kScales = kTileRows * G * 4;
  const int64_t num_blocks = p.K / kBlock;
  const uint8_t* record = p.packed + tile * num_blocks * kRecord;
  __m256 acc[kTileRows][TR];
  for (int r = 0; r < kTileRows; ++r)
    for (int t = 0; t < TR; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b, record += kRecord) {
    _mm_prefetch(reinterpret_cast<const char*>(record + 8 * kRecord), _MM_HINT_T0);
    for (int r = 0; r < kTileRows; ++r) {
      __m256 w[4];
      const __m256 d0 = _mm256_set1_ps(scale_at(record, r * G)), m0 = _mm256_set1_ps(scale_at(record + kScales, r * G));
      const __m256 d1 = G == 1 ? d0 : _mm256_set1_ps(scale_at(record, r * G + 1));
      const __m256 m1 = G == 1 ? m0 : _mm256_set1_ps(scale_at(record + kScales, r * G + 1));
      dequant256<Bits>(record + 2 * kScales + r * kCodes, d0, m0, d1, m1, w);
      for (int t = 0; t < TR; ++t) {
        const float* xb = p.x + (t0 + t) * p.K + b * kBlock;
        __m256 a = acc[r][t];
        for (int i = 0; i < 4; ++i) a = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), a);
        acc[r][t] = a;
      }
    }
  }
  for (int r = 0; r < kTileRows && tile * kTileRows + r < p.N; ++r)
    for (int t = 0; t < TR; ++t) p.y[(t0 + t) * p.N + tile * kTileRows + r] = hsum256(acc[r][t]);
}

// Input rows in groups of TR (4 with AVX-512's 32 registers, 2 with AVX2's 16), then the rest.
template <int Bits, int G, bool Wide>
void tile_rows(const Problem& p, int64_t tile) {
  int64_t t0 = 0;
  if constexpr (Wide) {
    for (; t0 + 4 <= p.T; t0 += 4) tile512<Bits, G, 4>(p, tile, t0);
    switch (p.T - t0) {
      case 3: tile512<Bits, G, 3>(p, tile, t0); break;
      case 2: tile512<Bits, G, 2>(p, tile, t0); break;
      case 1: tile512<Bits, G, 1>(p, tile, t0); break;
      default: break;
    }
  } else {
    for (; t0 + 2 <= p.T; t0 += 2) tile256<Bits, G, 2>(p, tile, t0);
    if (t0 < p.T) tile256<Bits, G, 1>(p, tile, t0);
  }
}

template <int Bits, int G, bool Wide>
void run(const Problem& p) {
  const int64_t num_tiles = (p.N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, num_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) tile_rows<Bits, G, Wide>(p, tile);
  });
}

template <int Bits, int G>
void dispatch(const Problem& p, int64_t isa) {
  if (isa == kIsaAvx512) run<Bits, G, true>(p);
  else run<Bits, G, false>(p);
}

#endif  // __x86_64__

int64_t best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512f")) return kIsaAvx512;
  if (avx2) return kIsaAvx2;
#endif
  return kIsaNone;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t bits, int64_t group,
                  int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [T, K] fp32, contiguous");
  TORCH_CHECK((bits == 4 && group == 32) || (bits == 8 && (group == 32 || group == 16)),
              "bits and group must be 4 and 32, or 8 and 32 or 16 (got ", bits, " and ", group, ")");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  const int64_t record = record_bytes(bits, kBlock / group);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == (N + kTileRows - 1) / kTileRows * (K / kBlock) * record,
              "packed must hold ceil(N / 4) * K / 32 records of ", record, " bytes");
  TORCH_CHECK(isa == kIsaAvx2 || isa == kIsaAvx512, "isa must be 1 (AVX2) or 2 (AVX-512)");
  TORCH_CHECK(isa <= best_isa(), "this CPU does not run isa ", isa);
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  Problem p{x.data_ptr<float>(), packed.data_ptr<uint8_t>(), y.data_ptr<float>(), T, N, K};
#if defined(__x86_64__)
  if (bits == 4) dispatch<4, 1>(p, isa);
  else if (group == 32) dispatch<8, 1>(p, isa);
  else dispatch<8, 2>(p, isa);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvreuse_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor packed, int N, int bits, int group, int isa) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) { m.impl("gguf_linear", &linear); }
