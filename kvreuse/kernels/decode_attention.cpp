// One layer's decode attention over the paged pool, in one call: each sequence's new K/V are written at its slot,
// then its one query attends to its whole context through its slots (GQA: query head h reads K/V head
// h / (H / Hkv)). fp32, softmax in fp32 with the maximum subtracted, as SDPA computes it; the same numbers up to
// summation order. It replaces ~10 torch ops per layer (index_copy, index_select, views, SDPA) whose dispatch,
// not arithmetic, was the decode step's cost at short contexts.
//
// The pool formats it reads and writes (kvreuse/layers/kv_format.py defines them; q, k, v are fp32 or bf16):
//   plain: a row is head_dim values in q's dtype (fp32 or bf16 pools), or bf16 values under fp32 queries.
//   int8 / fp8: a row is head_dim codes (int8, or float8_e4m3fn bits in uint8), then one fp16 scale per group of
//     g = group_size(head_dim) values (32 for head_dim 64), in the row's last 2 * head_dim / g bytes; a value is
//     code * scale. The new token's K/V are encoded as KVFormat.encode does, bit for bit; the context is
//     dequantized in registers (code * scale, in fp32: the very values `KVFormat.decode` gives in fp32).
// One attention loop serves every format: it reads rows through a row type (PlainRows, Int8Rows, Fp8Rows) that
// says what a code is worth and what its group's scale is. Where head_dim is a multiple of 32 (every model served
// today), the wide loop runs instead (attend_group_wide): 16 values to a vector, a group's scale applied once to the
// group's partial dot (K) or folded into the softmax weight (V), 16 keys' dot products reduced together, and the
// query heads' outputs accumulated in registers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attention_rows.h"
#include "hadamard.h"

#include <initializer_list>

namespace {

using namespace kvreuse_attention;

// x [D] -> one row of R, as KVFormat.encode computes it: per group of g, scale = fp16(clamp(absmax / max_code,
// fp16's smallest normal, fp16's largest)), code = encode(clamp(x / scale, -max_code, max_code)).
template <typename R, typename T>
void encode_row(const T* x, typename R::Code* row, int64_t D, int64_t g) {
  if constexpr (R::kMaxCode == 0.f) {
    for (int64_t d = 0; d < D; ++d) row[d] = R::encode(static_cast<float>(x[d]));
  } else {
    auto* scales = reinterpret_cast<c10::Half*>(row + D);
    for (int64_t start = 0; start < D; start += g) {
      float amax = 0.f;
      for (int64_t d = start; d < start + g; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
      const float raw = std::min(std::max(amax / R::kMaxCode, 6.103515625e-05f), 65504.f);
      const c10::Half scale(raw);
      const float s = static_cast<float>(scale);
      for (int64_t d = start; d < start + g; ++d)
        row[d] = R::encode(std::min(std::max(static_cast<float>(x[d]) / s, -R::kMaxCode), R::kMaxCode));
      std::memcpy(scales + start / g, &scale, sizeof(scale));  // the row's bytes may sit at any 2-byte boundary
    }
  }
}

// The (sequence, KV head) pairs [begin, end), each cloned per instruction set so that the loops above are vectorized
// for the CPU that runs them. q [B, H, D] and out [B, H, D] in T; query heads h * G .. h * G + G - 1 read KV head h.
template <typename T, typename R, bool kDot>
__attribute__((always_inline)) inline void attend_range(const T* q, const Pool<R>& pool, const int64_t* context,
                                                        const int64_t* lens, int64_t max_len, int64_t Hkv, int64_t G,
                                                        int64_t D, float scale, T* out, int64_t begin, int64_t end,
                                                        Scratch& s) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / Hkv, h = i % Hkv;
    const int64_t first = (b * Hkv + h) * G * D;  // the group's G query rows, one after another in q and out
    attend_row<T, R, kDot>(q + first, pool, context + b * max_len, lens[b], h * pool.width, G, D, scale, out + first,
                           s);
  }
}

template <typename T, typename R>
using AttendFn = void (*)(const T*, const Pool<R>&, const int64_t*, const int64_t*, int64_t, int64_t, int64_t,
                          int64_t, float, T*, int64_t, int64_t, Scratch&);


// Each compiled for AVX-512, AVX2 + FMA + F16C, and no extension; decode_attention runs the widest that both this CPU
// and torch's ATEN_CPU_CAPABILITY allow (so that `ATEN_CPU_CAPABILITY=avx2` tests the AVX2 variant on any CPU), and
// a bf16 pool's AVX-512 BF16 variant where the CPU has it (attend_dot), as the prefill kernel does.
#define KVREUSE_ATTEND_VARIANT(NAME, TARGET, T, R, DOT)                                                            \
  TARGET void NAME(const T* q, const Pool<R>& pool, const int64_t* context, const int64_t* lens, int64_t max_len,   \
                   int64_t Hkv, int64_t G, int64_t D, float scale, T* out, int64_t begin, int64_t end, Scratch& s) { \
    attend_range<T, R, DOT>(q, pool, context, lens, max_len, Hkv, G, D, scale, out, begin, end, s);               \
  }
#define KVREUSE_ATTEND_RANGE(NAME, T, R)                                                                             \
  KVREUSE_ATTEND_VARIANT(NAME##_avx512, __attribute__((target(KVREUSE_AVX512))), T, R, false)                        \
  KVREUSE_ATTEND_VARIANT(NAME##_avx2, __attribute__((target("avx2,fma,f16c"))), T, R, false)                         \
  KVREUSE_ATTEND_VARIANT(NAME##_default, , T, R, false)                                                              \
  const AttendFn<T, R> NAME[3] = {NAME##_default, NAME##_avx2, NAME##_avx512};
KVREUSE_ATTEND_RANGE(attend_fp32, float, PlainRows<float>)
KVREUSE_ATTEND_RANGE(attend_bf16, c10::BFloat16, PlainRows<c10::BFloat16>)
KVREUSE_ATTEND_RANGE(attend_fp32_bf16, float, PlainRows<c10::BFloat16>)
KVREUSE_ATTEND_RANGE(attend_fp32_int8, float, Int8Rows)
KVREUSE_ATTEND_RANGE(attend_bf16_int8, c10::BFloat16, Int8Rows)
KVREUSE_ATTEND_RANGE(attend_fp32_fp8, float, Fp8Rows)
KVREUSE_ATTEND_RANGE(attend_bf16_fp8, c10::BFloat16, Fp8Rows)
KVREUSE_ATTEND_VARIANT(attend_bf16_dot, __attribute__((target(KVREUSE_AVX512 ",avx512bf16"))), c10::BFloat16,
                       PlainRows<c10::BFloat16>, true)
#undef KVREUSE_ATTEND_RANGE
#undef KVREUSE_ATTEND_VARIANT

// Writes each sequence's new K/V (k, v [B, Hkv, D]) at its slot, then attends: the work of one pool format R.
template <typename T, typename R>
void store_and_attend(AttendFn<T, R> attend, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots, const int64_t* context,
                      const int64_t* lens, int64_t max_len, float scale, at::Tensor& out, int64_t grain) {
  using Code = typename R::Code;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  const int64_t width = k_cache.size(3);
  const Pool<R> pool{static_cast<const Code*>(k_cache.data_ptr()), static_cast<const Code*>(v_cache.data_ptr()),
                     Hkv * width, width, R::kMaxCode == 0.f ? D : group_size(D)};
  auto* kc = static_cast<Code*>(k_cache.data_ptr());
  auto* vc = static_cast<Code*>(v_cache.data_ptr());
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h) {
      encode_row<R>(kp + (b * Hkv + h) * D, kc + slots[b] * pool.stride + h * width, D, pool.g);
      encode_row<R>(vp + (b * Hkv + h) * D, vc + slots[b] * pool.stride + h * width, D, pool.g);
    }
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch(H / Hkv, max_len, D);
    attend(qp, pool, context, lens, max_len, Hkv, H / Hkv, D, scale, op, begin, end, scratch);
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& context_slots,
                            const at::Tensor& context_lens, double scale) {
  // q [B, H, D], k/v [B, Hkv, D] (fp32 or bf16); caches [num_blocks, block_size, Hkv, W]: q's dtype (or bf16 under
  // fp32 queries) with W = D, or
  // int8 / uint8 (fp8) with W = D + 2 * D / g; slot_mapping [B]; context_slots [B, max_context_len];
  // context_lens [B] (each >= 1, the new token included).
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q must be [B, H, D], k and v [B, Hkv, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(2) == D && H % Hkv == 0, "q, k, v disagree on B, D or the head groups");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "q must be fp32 or bf16");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous(), "q, k and v must share q's dtype, contiguous");
  const auto pool_dtype = k_cache.scalar_type();
  const bool quantized = pool_dtype == at::kChar || pool_dtype == at::kByte;
  TORCH_CHECK(pool_dtype == dtype || quantized || (pool_dtype == at::kBFloat16 && dtype == at::kFloat),
              "the caches must hold q's dtype, bf16 rows (under fp32 queries), int8 or fp8 (uint8) rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == pool_dtype,
              "the caches must share one dtype, contiguous");
  const int64_t width = quantized ? D + 2 * (D / group_size(D)) : D;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == Hkv && k_cache.size(3) == width &&
                  v_cache.sizes() == k_cache.sizes(),
              "the caches must be [num_blocks, block_size, Hkv, ", width, "]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&slot_mapping, &context_slots, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "slots and lengths must be int64, contiguous");
  TORCH_CHECK(slot_mapping.numel() == B && context_lens.numel() == B && context_slots.dim() == 2 &&
                  context_slots.size(0) == B,
              "slot_mapping, context_lens [B] and context_slots [B, max_context_len]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), max_len = context_slots.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* context = context_slots.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slots[b] >= 0 && slots[b] < num_slots, "slot ", slots[b], " is outside the pool");
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_len, "context length ", lens[b], " outside [1, ", max_len, "]");
    for (int64_t j = 0; j < lens[b]; ++j)
      TORCH_CHECK(context[b * max_len + j] >= 0 && context[b * max_len + j] < num_slots, "a context slot is outside the pool");
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  const float s = static_cast<float>(scale);
  // One (sequence, KV head) per task: enough work to split once contexts are long, one thread when they are short.
  int64_t total_keys = 0;
  for (int64_t b = 0; b < B; ++b) total_keys += lens[b];
  const int64_t grain = std::max<int64_t>(1, (B * Hkv) * 1024 / std::max<int64_t>(1, total_keys * Hkv));
  using BF16 = c10::BFloat16;
  const bool fp32 = dtype == at::kFloat;
  const auto isa = static_cast<int>(attend_isa());  // an index into each kernel's variants
#define KVREUSE_RUN(FN, T, R) \
  store_and_attend<T, R>(FN[isa], q, k, v, k_cache, v_cache, slots, context, lens, max_len, s, out, grain)
  if (pool_dtype == at::kChar) {
    if (fp32) KVREUSE_RUN(attend_fp32_int8, float, Int8Rows);
    else KVREUSE_RUN(attend_bf16_int8, BF16, Int8Rows);
  } else if (pool_dtype == at::kByte) {
    if (fp32) KVREUSE_RUN(attend_fp32_fp8, float, Fp8Rows);
    else KVREUSE_RUN(attend_bf16_fp8, BF16, Fp8Rows);
  } else if (pool_dtype == at::kFloat) {
    KVREUSE_RUN(attend_fp32, float, PlainRows<float>);
  } else if (fp32) {  // fp32 queries over bf16 rows: no bf16 pairs, a query is not a bf16 value
    KVREUSE_RUN(attend_fp32_bf16, float, PlainRows<BF16>);
  } else {
    store_and_attend<BF16, PlainRows<BF16>>(attend_dot() ? attend_bf16_dot : attend_bf16[isa], q, k, v, k_cache,
                                            v_cache, slots, context, lens, max_len, s, out, grain);
  }
#undef KVREUSE_RUN
  return out.view({B, H * D});
}

at::Tensor decode_attention_in(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& context_slots,
                               const at::Tensor& context_lens, double scale, bool rotated) {
  // rotated: the pool holds rows in the 8-bit formats' Hadamard basis (kv_format.py, `to_basis`): q, k and v go into
  // it before the attention, and each head's output comes back after, here rather than in four more op calls a layer.
  if (!rotated)
    return decode_attention(q, k, v, k_cache, v_cache, slot_mapping, context_slots, context_lens, scale);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "q must be [B, H, D]; q, k and v contiguous");
  const at::Tensor out = decode_attention(kvreuse::hadamard(q), kvreuse::hadamard(k), kvreuse::hadamard(v), k_cache,
                                          v_cache, slot_mapping, context_slots, context_lens, scale);  // [B, H * D]
  return kvreuse::hadamard(out.view(q.sizes())).view(out.sizes());
}

bool bf16_dot() { return attend_dot(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvreuse_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor context_slots, Tensor context_lens, float scale, bool rotated=False) -> Tensor");
  m.def("bf16_dot() -> bool", &bf16_dot);  // whether a bf16 pool's scores take the bf16 dot products (attend_dot)
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) { m.impl("decode_attention", &decode_attention_in); }
