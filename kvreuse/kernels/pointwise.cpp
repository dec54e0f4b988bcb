// A layer's row-wise steps besides attention and the linears: RMSNorm (both conventions), RoPE (rotate-half), the
// gated activations (SwiGLU, GeGLU with tanh GELU) and a scale (Gemma's embedding), one op each. The engine calls them eagerly and the compiled decode
// step calls them from its graph, so a row gets the same bits either way (kvreuse/layers/pointwise.py); inductor's
// own fusion of the torch ops kept bf16 intermediates in fp32 and took its own exp and sums.
//
// Each row is computed from its own values in one order, whatever rows share the call: the sum of squares in 16
// partial sums (value i into sum i % 16) folded in halves, then the row scaled; RoPE and the activations value by
// value. Every value that the torch ops round to the model dtype is rounded here at the same place (bf16: to nearest,
// ties to even, as torch rounds), so in bf16 RoPE gives torch's bits, and the norm and the activations differ from
// torch's only where the sum's order or the exp's last bit does. Compiled for AVX-512, AVX2 and no extension, as the
// plain loops that GCC vectorizes, chosen as the attention kernels choose (attend_isa).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "attention_rows.h"  // attend_isa, exp_nonpositive, KVREUSE_AVX512
#include "bf16.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace {

using kvreuse::bf16_bits;
using kvreuse::bf16_value;
using kvreuse_attention::exp_nonpositive;

// Storage of a tensor's values: fp32 as it is, bf16 as its bits.
template <typename T>
struct Values;

template <>
struct Values<float> {
  using Bits = float;
  static float load(Bits v) { return v; }
  static Bits store(float x) { return x; }
  static float round(float x) { return x; }  // x as the dtype holds it
};

template <>
struct Values<c10::BFloat16> {
  using Bits = uint16_t;
  static float load(Bits v) { return bf16_value(v); }
  static Bits store(float x) { return bf16_bits(x); }
  static float round(float x) { return bf16_value(bf16_bits(x)); }
};

// ---- RMSNorm ----
// out = x / sqrt(mean(x^2) + eps) * w. kRoundFirst: the normalised x is rounded to the dtype before the weight
// (Llama's convention: w in the dtype); otherwise the product is rounded once (Gemma's: w = 1 + w' in fp32).
template <typename T, typename W, bool kRoundFirst>
__attribute__((always_inline)) inline void norm_row(const typename Values<T>::Bits* x, const W* w,
                                                    typename Values<T>::Bits* out, int64_t D, float eps,
                                                    float* buffer) {
  using V = Values<T>;
  for (int64_t i = 0; i < D; ++i) buffer[i] = V::load(x[i]);
  float sums[16] = {};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16)
    for (int l = 0; l < 16; ++l) sums[l] += buffer[i + l] * buffer[i + l];
  for (; i < D; ++i) sums[i % 16] += buffer[i] * buffer[i];
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) sums[l] += sums[l + width];
  const float inverse = 1.0f / std::sqrt(sums[0] / static_cast<float>(D) + eps);
  for (int64_t j = 0; j < D; ++j) {
    const float normalised = kRoundFirst ? V::round(buffer[j] * inverse) : buffer[j] * inverse;
    out[j] = V::store(normalised * static_cast<float>(w[j]));
  }
}

// ---- RoPE, rotate-half: out_i = x_i cos_i + r_i sin_i, r = (-x[D/2:], x[:D/2]) ----
// Each product and the sum rounded to the dtype, as torch's three ops round them.
template <typename T>
__attribute__((always_inline)) inline void rotary_row(const typename Values<T>::Bits* x,
                                                      const typename Values<T>::Bits* cos,
                                                      const typename Values<T>::Bits* sin,
                                                      typename Values<T>::Bits* out, int64_t D) {
  using V = Values<T>;
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float rotated = i < half ? -V::load(x[i + half]) : V::load(x[i - half]);
    const float a = V::round(V::load(x[i]) * V::load(cos[i]));
    const float b = V::round(rotated * V::load(sin[i]));
    out[i] = V::store(a + b);
  }
}

// ---- Gated activations: out = act(gate) * up, act(gate) rounded to the dtype first (torch's two ops) ----
// x sigmoid(z) from e = exp(-|z|) <= 1 (exp_nonpositive's range, no overflow): sigmoid(z) = 1 / (1 + e) for z >= 0,
// e / (1 + e) below, with no cancellation on either side.
__attribute__((always_inline)) inline float times_sigmoid(float x, float z) {
  const float e = exp_nonpositive(-std::fabs(z));
  return x * ((z >= 0.0f ? 1.0f : e) / (1.0f + e));
}

__attribute__((always_inline)) inline float silu(float x) { return times_sigmoid(x, x); }

// 0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2 / pi) (x + 0.044715 x^3)
__attribute__((always_inline)) inline float gelu_tanh(float x) {
  return times_sigmoid(x, 1.5957691216057308f * (x + 0.044715f * x * x * x));
}

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

template <typename T, Activation kAct>
__attribute__((always_inline)) inline void gated_row(const typename Values<T>::Bits* gate,
                                                     const typename Values<T>::Bits* up,
                                                     typename Values<T>::Bits* out, int64_t I) {
  using V = Values<T>;
  for (int64_t i = 0; i < I; ++i) {
    const float g = V::load(gate[i]);
    const float act = V::round(kAct == kSilu ? silu(g) : gelu_tanh(g));
    out[i] = V::store(act * V::load(up[i]));
  }
}

// ---- A scale: out = x * s, rounded once (Gemma's embedding times sqrt(hidden), s already in the dtype) ----
template <typename T>
__attribute__((always_inline)) inline void scaled_row(const typename Values<T>::Bits* x, float s,
                                                      typename Values<T>::Bits* out, int64_t D) {
  using V = Values<T>;
  for (int64_t i = 0; i < D; ++i) out[i] = V::store(V::load(x[i]) * s);
}

// ---- Variants: each row function compiled for each instruction set ----
template <typename T>
using Bits = typename Values<T>::Bits;
template <typename T, typename W>
using NormFn = void (*)(const Bits<T>*, const W*, Bits<T>*, int64_t, float, float*);
template <typename T>
using RotaryFn = void (*)(const Bits<T>*, const Bits<T>*, const Bits<T>*, Bits<T>*, int64_t);
template <typename T>
using GatedFn = void (*)(const Bits<T>*, const Bits<T>*, Bits<T>*, int64_t);
template <typename T>
using ScaledFn = void (*)(const Bits<T>*, float, Bits<T>*, int64_t);

#define KVREUSE_POINTWISE_VARIANTS(SUFFIX, TARGET)                                                                  \
  template <typename T, typename W, bool kRoundFirst>                                                               \
  TARGET void norm_##SUFFIX(const Bits<T>* x, const W* w, Bits<T>* out, int64_t D, float eps, float* buffer) {       \
    norm_row<T, W, kRoundFirst>(x, w, out, D, eps, buffer);                                                          \
  }                                                                                                                  \
  template <typename T>                                                                                              \
  TARGET void rotary_##SUFFIX(const Bits<T>* x, const Bits<T>* cos, const Bits<T>* sin, Bits<T>* out, int64_t D) {  \
    rotary_row<T>(x, cos, sin, out, D);                                                                              \
  }                                                                                                                  \
  template <typename T, Activation kAct>                                                                             \
  TARGET void gated_##SUFFIX(const Bits<T>* gate, const Bits<T>* up, Bits<T>* out, int64_t I) {                      \
    gated_row<T, kAct>(gate, up, out, I);                                                                            \
  }                                                                                                                  \
  template <typename T>                                                                                              \
  TARGET void scaled_##SUFFIX(const Bits<T>* x, float s, Bits<T>* out, int64_t D) { scaled_row<T>(x, s, out, D); }
KVREUSE_POINTWISE_VARIANTS(avx512, __attribute__((target(KVREUSE_AVX512))))
KVREUSE_POINTWISE_VARIANTS(avx2, __attribute__((target("avx2,fma,f16c"))))
KVREUSE_POINTWISE_VARIANTS(default, )
#undef KVREUSE_POINTWISE_VARIANTS

// The variant of this CPU (attend_isa: 0 none, 1 AVX2, 2 AVX-512).
template <typename T, typename W, bool kRoundFirst>
NormFn<T, W> norm_fn() {
  const NormFn<T, W> fns[3] = {norm_default<T, W, kRoundFirst>, norm_avx2<T, W, kRoundFirst>,
                               norm_avx512<T, W, kRoundFirst>};
  return fns[static_cast<int>(kvreuse_attention::attend_isa())];
}

template <typename T>
RotaryFn<T> rotary_fn() {
  const RotaryFn<T> fns[3] = {rotary_default<T>, rotary_avx2<T>, rotary_avx512<T>};
  return fns[static_cast<int>(kvreuse_attention::attend_isa())];
}

template <typename T, Activation kAct>
GatedFn<T> gated_fn() {
  const GatedFn<T> fns[3] = {gated_default<T, kAct>, gated_avx2<T, kAct>, gated_avx512<T, kAct>};
  return fns[static_cast<int>(kvreuse_attention::attend_isa())];
}

template <typename T>
ScaledFn<T> scaled_fn() {
  const ScaledFn<T> fns[3] = {scaled_default<T>, scaled_avx2<T>, scaled_avx512<T>};
  return fns[static_cast<int>(kvreuse_attention::attend_isa())];
}

// Rows of [N, H, D] (a 2-D tensor is [N, 1, D]): row (n, h) at n * stride_n + h * stride_h, values contiguous.
struct Rows {
  int64_t N, H, D, stride_n, stride_h;

  static Rows of(const at::Tensor& x, const char* name) {
    TORCH_CHECK(x.dim() == 2 || x.dim() == 3, name, " must be [N, D] or [N, H, D]");
    TORCH_CHECK(x.stride(-1) == 1, name, "'s rows must be contiguous");
    const bool heads = x.dim() == 3;
    return {x.size(0), heads ? x.size(1) : 1, x.size(-1), x.stride(0), heads ? x.stride(1) : 0};
  }
  int64_t offset(int64_t row) const { return (row / H) * stride_n + (row % H) * stride_h; }
};

void check_dtype(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16, not ",
              x.scalar_type());
}

// Rows [0, N * H) in parallel, at least ~32k values a thread: a decode step's few rows run on the calling thread.
template <typename F>
void each_row(const Rows& rows, F fn) {
  at::parallel_for(0, rows.N * rows.H, std::max<int64_t>(1, 32768 / std::max<int64_t>(rows.D, 1)), fn);
}

template <typename T, typename W, bool kRoundFirst>
void norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps) {
  const Rows rows = Rows::of(x, "x");
  const auto* from = reinterpret_cast<const Bits<T>*>(x.const_data_ptr());
  const W* w = weight.const_data_ptr<W>();
  auto* to = reinterpret_cast<Bits<T>*>(out.mutable_data_ptr());
  const auto fn = norm_fn<T, W, kRoundFirst>();
  each_row(rows, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(rows.D);
    for (int64_t r = begin; r < end; ++r)
      fn(from + rows.offset(r), w, to + r * rows.D, rows.D, static_cast<float>(eps), buffer.data());
  });
}

// x [N, D] or [N, H, D] (rows contiguous); weight [D], x's dtype or fp32 -> contiguous, x's shape and dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool round_first) {
  check_dtype(x);
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1),
              "weight must be [D], contiguous, D = ", x.size(-1));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "weight must be fp32 or x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const bool fp32_weight = weight.scalar_type() == at::kFloat;
  if (x.scalar_type() == at::kFloat) norm_rows<float, float, false>(x, weight, out, eps);
  else if (fp32_weight) {
    if (round_first) norm_rows<c10::BFloat16, float, true>(x, weight, out, eps);
    else norm_rows<c10::BFloat16, float, false>(x, weight, out, eps);
  } else {
    if (round_first) norm_rows<c10::BFloat16, c10::BFloat16, true>(x, weight, out, eps);
    else norm_rows<c10::BFloat16, c10::BFloat16, false>(x, weight, out, eps);
  }
  return out;
}

template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const Rows rows = Rows::of(x, "x");
  const auto* from = reinterpret_cast<const Bits<T>*>(x.const_data_ptr());
  const auto* c = reinterpret_cast<const Bits<T>*>(cos.const_data_ptr());
  const auto* s = reinterpret_cast<const Bits<T>*>(sin.const_data_ptr());
  auto* to = reinterpret_cast<Bits<T>*>(out.mutable_data_ptr());
  const auto fn = rotary_fn<T>();
  each_row(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / rows.H;  // the row's position: its cos and sin
      fn(from + rows.offset(r), c + n * rows.D, s + n * rows.D, to + r * rows.D, rows.D);
    }
  });
}

template <typename T, Activation kAct>
void gated_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  const auto* from = reinterpret_cast<const Bits<T>*>(gate_up.const_data_ptr());
  auto* to = reinterpret_cast<Bits<T>*>(out.mutable_data_ptr());
  const auto fn = gated_fn<T, kAct>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) fn(from + n * 2 * I, from + n * 2 * I + I, to + n * I, I);
  });
}

// x [N, H, D] (rows contiguous), cos and sin [N, 1, D] or [N, D], contiguous, x's dtype -> contiguous [N, H, D].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(x);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == x.scalar_type() && t->numel() == x.size(0) * x.size(-1),
                "cos and sin must be [N, 1, D], contiguous, in x's dtype");
  }
  TORCH_CHECK(x.size(-1) % 2 == 0, "D must be even");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) rotary_rows<float>(x, cos, sin, out);
  else rotary_rows<c10::BFloat16>(x, cos, sin, out);
  return out;
}

// gate_up [N, 2I] contiguous (gate, then up) -> [N, I]: act(gate) * up; activation 0: SiLU, 1: tanh GELU.
at::Tensor gated(const at::Tensor& gate_up, int64_t activation) {
  check_dtype(gate_up);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be [N, 2I], contiguous");
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh, "activation must be 0 (silu) or 1 (gelu_tanh), not ",
              activation);
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (out.numel() == 0) return out;
  const bool fp32 = gate_up.scalar_type() == at::kFloat;
  if (activation == kSilu) fp32 ? gated_rows<float, kSilu>(gate_up, out) : gated_rows<c10::BFloat16, kSilu>(gate_up, out);
  else fp32 ? gated_rows<float, kGeluTanh>(gate_up, out) : gated_rows<c10::BFloat16, kGeluTanh>(gate_up, out);
  return out;
}

template <typename T>
void scaled_rows(const at::Tensor& x, double s, at::Tensor& out) {
  const Rows rows = Rows::of(x, "x");
  const auto* from = reinterpret_cast<const Bits<T>*>(x.const_data_ptr());
  auto* to = reinterpret_cast<Bits<T>*>(out.mutable_data_ptr());
  const auto fn = scaled_fn<T>();
  each_row(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(from + r * rows.D, static_cast<float>(s), to + r * rows.D, rows.D);
  });
}

// x [N, D] contiguous -> x * s, rounded once to x's dtype.
at::Tensor scaled(const at::Tensor& x, double s) {
  check_dtype(x);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be [N, D], contiguous");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) scaled_rows<float>(x, s, out);
  else scaled_rows<c10::BFloat16>(x, s, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvreuse_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool round_first) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("gated(Tensor gate_up, int activation) -> Tensor");
  m.def("scaled(Tensor x, float s) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("gated", &gated);
  m.impl("scaled", &scaled);
}
