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
// One source, compiled once for the baseline x86-64 target: the body (gguf_linear_body.h) is written once over a
// vector type and included twice, each time in a target region of its own (AVX-512, AVX2; GCC's target pragmas, as
// g++ builds torch's extensions on Linux) with that set's vector type, and `best_isa()` says which one this CPU runs
// (0: neither; the caller then dequantizes in torch).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "bf16.h"
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

// ---- AVX-512: a panel's 16 rows are one vector ----

#pragma GCC push_options
#pragma GCC target("avx512f,fma,avx2,f16c")
namespace avx512 {

struct V {
  using Vec = __m512;
  using IVec = __m512i;
  static constexpr int kLanes = 16;
  static constexpr int kPassRows = 8;       // 2 x 8 accumulators
  static constexpr int kRegisterRows = 16;
  static constexpr int kTileRows = 12;      // 2 x 12 accumulators of 32 registers
  static constexpr int kPassUnroll = 4, kTileUnroll = 2;

  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_half(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, Vec v, int64_t n) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
  static Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  // 16 bytes of codes, one per lane.
  static IVec widen_codes(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static IVec low_nibbles(IVec q) { return _mm512_and_si512(q, _mm512_set1_epi32(15)); }
  static IVec high_nibbles(IVec q) { return _mm512_srli_epi32(q, 4); }
  static Vec to_float(IVec q) { return _mm512_cvtepi32_ps(q); }
};

#include "gguf_linear_body.h"

}  // namespace avx512
#pragma GCC pop_options

// ---- AVX2: a panel's 16 rows are two 8-lane halves, each its own pass (16 registers) ----

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

struct V {
  using Vec = __m256;
  using IVec = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int kPassRows = 4;       // 2 x 4 accumulators
  static constexpr int kRegisterRows = 8;
  static constexpr int kTileRows = 5;       // 2 x 5 accumulators of 16 registers
  static constexpr int kPassUnroll = 2, kTileUnroll = 1;

  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load_half(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, Vec v, int64_t n) {
    if (n == kLanes) return _mm256_storeu_ps(p, v);
    alignas(32) float lanes[kLanes];
    _mm256_store_ps(lanes, v);
    std::copy(lanes, lanes + n, p);
  }
  static Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  // 8 bytes of codes, one per lane.
  static IVec widen_codes(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static IVec low_nibbles(IVec q) { return _mm256_and_si256(q, _mm256_set1_epi32(15)); }
  static IVec high_nibbles(IVec q) { return _mm256_srli_epi32(q, 4); }
  static Vec to_float(IVec q) { return _mm256_cvtepi32_ps(q); }
};

#include "gguf_linear_body.h"

}  // namespace avx2
#pragma GCC pop_options

template <int Bits, int G, bool Half>
void run(const Problem& p, Isa isa) {
  const int64_t num_panels = (p.N + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, 2, [&](int64_t begin, int64_t end) {
    const int register_rows = isa == Isa::kAvx512 ? avx512::V::kRegisterRows : avx2::V::kRegisterRows;
    std::vector<float> w(p.T > register_rows ? p.K * kPanel : 0);  // the dequantized panel, when tiles read it
    for (int64_t panel = begin; panel < end; ++panel) {
      if (isa == Isa::kAvx512) avx512::panel_rows<Bits, G, Half>(p, panel, w.data());
      else avx2::panel_rows<Bits, G, Half>(p, panel, w.data());
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

// bf16 rows widened and products rounded as loops of bf16.h's bit operations, which GCC vectorizes: a cast through
// the dispatcher cost ~2 us, and c10's scalar rounding ~2 ns a value (a 3,072-wide gate_up row: 6 us), four linears a
// layer.
at::Tensor widened(const at::Tensor& x) {
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const uint16_t* from = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  float* to = out.mutable_data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) to[i] = kvreuse::bf16_value(from[i]);
  return out;
}

at::Tensor rounded(const at::Tensor& y) {
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(at::kBFloat16));
  const float* from = y.const_data_ptr<float>();
  uint16_t* to = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t n = y.numel();
  for (int64_t i = 0; i < n; ++i) to[i] = kvreuse::bf16_bits(from[i]);
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t bits, int64_t group,
                  bool half_scales, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [T, K] fp32 or bf16, contiguous");
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
  // bf16 rows are widened, multiplied in fp32 and the products rounded back here, as torch's casts would round them
  // around the op: inside it, a compiled graph cannot fuse the rounding away (it keeps fused values in fp32).
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor x32 = bf16 ? widened(x) : x;
  at::Tensor y = at::empty({T, N}, x32.options());
  if (T == 0 || N == 0) return bf16 ? at::empty({T, N}, x.options()) : y;
  Problem p{x32.data_ptr<float>(), packed.data_ptr<uint8_t>(), y.data_ptr<float>(), T, N, K};
#if defined(__x86_64__)
  if (half_scales) dispatch<true>(p, bits, group, static_cast<Isa>(isa));
  else dispatch<false>(p, bits, group, static_cast<Isa>(isa));
#endif
  return bf16 ? rounded(y) : y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvreuse_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor packed, int N, int bits, int group, bool half_scales, int isa) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) { m.impl("gguf_linear", &linear); }
