// The Hadamard basis of the 8-bit KV formats (kvreuse/layers/kv_format.py, `rotate`): each run of P values of a row
// (P = the largest power of two that divides the row's length) times the normalized Hadamard matrix of size P, by the
// fast Walsh-Hadamard transform: log2(P) rounds of butterflies in fp32, the round of half h taking each pair
// (a, b) = (x[i], x[i + h]) of every block of 2h values to (a + b, a - b), then one multiply by 1 / sqrt(P). A run's
// numbers come from its own values in one order, so a row gets the same bits whatever rows share the call; a GEMM's
// would not (MKL sums a 256-wide row another way when fewer than 4 rows share it). The torch fallback
// (`rotate_in_torch`) takes the same butterflies in the same order: the same bits.
//
// Where P is a multiple of 16 (head_dim 64, 128, 256), a run is P / 16 vectors of 16 lanes: the rounds of half 16
// and more add and subtract whole vectors, those of half 1 to 8 pair lanes within a vector by a shuffle (lane l's
// partner is lane l ^ h; a + b and a - b as IEEE sums are the same whichever operand comes first). Compiled for
// AVX-512, AVX2 and no extension, chosen as the attention kernels choose (attend_isa).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "attention_rows.h"  // attend_isa
#include "hadamard.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float Lanes __attribute__((vector_size(64)));
typedef int32_t LaneIndex __attribute__((vector_size(64)));

constexpr LaneIndex kLane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// One run's round of half h < 16 over each of its vectors: lane l with bit h clear gets x[l] + x[l ^ h], the other
// lane x[l ^ h] - x[l].
template <int H>
__attribute__((always_inline)) inline Lanes lane_round(Lanes x) {
  const Lanes partner = __builtin_shuffle(x, kLane ^ H);
  return (kLane & H) ? partner - x : x + partner;
}

// The rounds of half 1, 2, 4, ... < n over n elements (values, or vectors of 16 values), then each times scale.
template <typename E>
__attribute__((always_inline)) inline void butterflies(E* v, int64_t n, float scale) {
  for (int64_t half = 1; half < n; half *= 2)
    for (int64_t block = 0; block < n; block += 2 * half)
      for (int64_t i = block; i < block + half; ++i) {
        const E a = v[i], b = v[i + half];
        v[i] = a + b;
        v[i + half] = a - b;
      }
  for (int64_t i = 0; i < n; ++i) v[i] *= scale;
}

// A run of P = NV * 16 values already in fp32 at `values`, rotated in place: the rounds of half 1 to 8 within each
// vector, then those of half 16, 32, ... over whole vectors.
template <int NV>
__attribute__((always_inline)) inline void rotate_wide(float* values, float scale) {
  Lanes v[NV];
  std::memcpy(v, values, sizeof(v));
  for (int i = 0; i < NV; ++i) v[i] = lane_round<8>(lane_round<4>(lane_round<2>(lane_round<1>(v[i]))));
  butterflies<Lanes>(v, NV, scale);
  std::memcpy(values, v, sizeof(v));
}

// Runs [begin, end) of x, each P values, into out; buffer: P floats.
template <typename T>
__attribute__((always_inline)) inline void rotate_runs(const T* x, T* out, int64_t P, float scale, int64_t begin,
                                                       int64_t end, float* buffer) {
  for (int64_t r = begin; r < end; ++r) {
    const T* from = x + r * P;
    for (int64_t i = 0; i < P; ++i) buffer[i] = static_cast<float>(from[i]);
    if (P == 64) rotate_wide<4>(buffer, scale);
    else if (P == 128) rotate_wide<8>(buffer, scale);
    else if (P == 256) rotate_wide<16>(buffer, scale);
    else butterflies<float>(buffer, P, scale);  // any power-of-two P, a value at a time
    T* to = out + r * P;
    for (int64_t i = 0; i < P; ++i) to[i] = static_cast<T>(buffer[i]);
  }
}

template <typename T>
using RotateFn = void (*)(const T*, T*, int64_t, float, int64_t, int64_t, float*);

#define KVREUSE_ROTATE_VARIANT(NAME, TARGET, T)                                                              \
  TARGET void NAME(const T* x, T* out, int64_t P, float scale, int64_t begin, int64_t end, float* buffer) { \
    rotate_runs<T>(x, out, P, scale, begin, end, buffer);                                                    \
  }
#define KVREUSE_ROTATE(NAME, T)                                                                                  \
  KVREUSE_ROTATE_VARIANT(NAME##_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                         T)                                                                                      \
  KVREUSE_ROTATE_VARIANT(NAME##_avx2, __attribute__((target("avx2,fma,f16c"))), T)                               \
  KVREUSE_ROTATE_VARIANT(NAME##_default, , T)                                                                    \
  const RotateFn<T> NAME[3] = {NAME##_default, NAME##_avx2, NAME##_avx512};
KVREUSE_ROTATE(rotate_fp32, float)
KVREUSE_ROTATE(rotate_bf16, c10::BFloat16)
#undef KVREUSE_ROTATE
#undef KVREUSE_ROTATE_VARIANT

template <typename T>
void run(RotateFn<T> fn, const at::Tensor& x, at::Tensor& out, int64_t P, float scale) {
  const T* from = x.data_ptr<T>();
  T* to = out.data_ptr<T>();
  const int64_t runs = x.numel() / P;
  at::parallel_for(0, runs, std::max<int64_t>(1, 65536 / P), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(P);  // one thread for a decode step's few rows
    fn(from, to, P, scale, begin, end, buffer.data());
  });
}

}  // namespace

at::Tensor kvreuse::hadamard(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x must be [..., D], contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be fp32 or bf16");
  const int64_t D = x.size(-1);
  TORCH_CHECK(D > 0, "a row must hold values");
  const int64_t P = D & -D;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(P)));
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const auto isa = static_cast<int>(kvreuse_attention::attend_isa());
  if (dtype == at::kFloat) run<float>(rotate_fp32[isa], x, out, P, scale);
  else run<c10::BFloat16>(rotate_bf16[isa], x, out, P, scale);
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvreuse_cpu, m) { m.def("hadamard(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) { m.impl("hadamard", &kvreuse::hadamard); }
