// One layer's attention for a forward's query rows (prompt rows, and decode rows that ride along with them) over the
// paged pool, each row computed alone: its G query heads against its visible keys (0 .. its position, or the last
// `window` of them), in the one order attend_row gives. A row's numbers therefore do not depend on how many query
// rows the step has or which rows share it, and equal those the decode kernel gives the same row (SDPA's CPU kernel
// multiplies a block of a sequence's query rows by its keys in one GEMM, whose summation order follows the block's
// row count: docs/design/batch-invariance.md). The pool is read in its own format (fp32, bf16, int8, fp8 rows), as
// the decode kernel reads it: no dequantized copy of the context.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attention_rows.h"

#include <initializer_list>

namespace {

using namespace kvreuse_attention;

// The query rows in an order whose halves (and quarters, roughly) hold equal work: row n / 2 for even n, row
// T - 1 - n / 2 for odd n, so a thread's contiguous share of tasks pairs a short causal row with a long one.
inline int64_t balanced_row(int64_t n, int64_t T) { return n % 2 == 0 ? n / 2 : T - 1 - n / 2; }

// Tasks [begin, end) of T * Hkv (row, KV head) pairs. q, out [T, H, D] in T_; row t of sequence row_seq[t] at
// position row_pos[t] reads context slots [first, row_pos[t]] of its sequence's row of `context` [B, K].
template <typename T_, typename R>
__attribute__((always_inline)) inline void prefill_range(const T_* q, const Pool<R>& pool, const int64_t* context,
                                                         int64_t K, const int64_t* row_seq, const int64_t* row_pos,
                                                         int64_t window, int64_t T, int64_t Hkv, int64_t G,
                                                         int64_t D, float scale, T_* out, int64_t begin, int64_t end,
                                                         Scratch& s) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t t = balanced_row(i / Hkv, T), h = i % Hkv;
    const int64_t position = row_pos[t];
    const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
    const int64_t at = (t * Hkv + h) * G * D;  // the row's G query heads of KV head h
    attend_row<T_, R>(q + at, pool, context + row_seq[t] * K + first, position - first + 1, h * pool.width, G, D,
                      scale, out + at, s);
  }
}

template <typename T_, typename R>
using PrefillFn = void (*)(const T_*, const Pool<R>&, const int64_t*, int64_t, const int64_t*, const int64_t*,
                           int64_t, int64_t, int64_t, int64_t, int64_t, float, T_*, int64_t, int64_t, Scratch&);

// Each compiled for AVX-512, AVX2 + FMA + F16C, and no extension, as the decode kernel's variants are: a row gets the
// same code in either kernel for the instruction set both pick (attend_isa).
#define KVREUSE_PREFILL_VARIANT(NAME, TARGET, T_, R)                                                                \
  TARGET void NAME(const T_* q, const Pool<R>& pool, const int64_t* context, int64_t K, const int64_t* row_seq,     \
                   const int64_t* row_pos, int64_t window, int64_t T, int64_t Hkv, int64_t G, int64_t D,            \
                   float scale, T_* out, int64_t begin, int64_t end, Scratch& s) {                                  \
    prefill_range<T_, R>(q, pool, context, K, row_seq, row_pos, window, T, Hkv, G, D, scale, out, begin, end, s); \
  }
#define KVREUSE_PREFILL_RANGE(NAME, T_, R)                                                                           \
  KVREUSE_PREFILL_VARIANT(NAME##_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                          T_, R)                                                                                     \
  KVREUSE_PREFILL_VARIANT(NAME##_avx2, __attribute__((target("avx2,fma,f16c"))), T_, R)                              \
  KVREUSE_PREFILL_VARIANT(NAME##_default, , T_, R)                                                                   \
  const PrefillFn<T_, R> NAME[3] = {NAME##_default, NAME##_avx2, NAME##_avx512};
KVREUSE_PREFILL_RANGE(prefill_fp32, float, PlainRows<float>)
KVREUSE_PREFILL_RANGE(prefill_bf16, c10::BFloat16, PlainRows<c10::BFloat16>)
KVREUSE_PREFILL_RANGE(prefill_fp32_int8, float, Int8Rows)
KVREUSE_PREFILL_RANGE(prefill_bf16_int8, c10::BFloat16, Int8Rows)
KVREUSE_PREFILL_RANGE(prefill_fp32_fp8, float, Fp8Rows)
KVREUSE_PREFILL_RANGE(prefill_bf16_fp8, c10::BFloat16, Fp8Rows)
#undef KVREUSE_PREFILL_RANGE
#undef KVREUSE_PREFILL_VARIANT

template <typename T_, typename R>
void run(PrefillFn<T_, R> fn, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const int64_t* context, int64_t K, const int64_t* row_seq, const int64_t* row_pos, int64_t window,
         int64_t max_len, float scale, at::Tensor& out, int64_t grain) {
  using Code = typename R::Code;
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), width = k_cache.size(3);
  const Pool<R> pool{static_cast<const Code*>(k_cache.data_ptr()), static_cast<const Code*>(v_cache.data_ptr()),
                     Hkv * width, width, R::kMaxCode == 0.f ? D : group_size(D)};
  const T_* qp = q.data_ptr<T_>();
  T_* op = out.data_ptr<T_>();
  at::parallel_for(0, T * Hkv, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch(H / Hkv, max_len, D);
    fn(qp, pool, context, K, row_seq, row_pos, window, T, Hkv, H / Hkv, D, scale, op, begin, end, scratch);
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& context_slots, const at::Tensor& row_seq, const at::Tensor& row_pos,
                             int64_t window, double scale) {
  // q [T, H, D] (fp32 or bf16, already rotated; the rows' K/V already in the pool); caches [num_blocks, block_size,
  // Hkv, W] as decode_attention takes them; context_slots [B, K]: slot of each sequence's key at each position;
  // row_seq, row_pos [T]: each row's sequence and position (< K). window 0: every key up to the row's position.
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be [T, H, D], contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "q must be fp32 or bf16");
  const auto pool_dtype = k_cache.scalar_type();
  const bool quantized = pool_dtype == at::kChar || pool_dtype == at::kByte;
  TORCH_CHECK(pool_dtype == dtype || quantized, "the caches must hold q's dtype, int8 or fp8 (uint8) rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == pool_dtype &&
                  k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "the caches must be [num_blocks, block_size, Hkv, W], one dtype, contiguous");
  const int64_t Hkv = k_cache.size(2);
  const int64_t width = quantized ? D + 2 * (D / group_size(D)) : D;
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == width, "the caches must be [num_blocks, block_size, Hkv, ", width,
              "] with H a multiple of Hkv");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&context_slots, &row_seq, &row_pos})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "slots and rows must be int64, contiguous");
  TORCH_CHECK(context_slots.dim() == 2 && row_seq.numel() == T && row_pos.numel() == T,
              "context_slots [B, K], row_seq and row_pos [T]");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  const int64_t B = context_slots.size(0), K = context_slots.size(1);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* context = context_slots.data_ptr<int64_t>();
  const int64_t* seqs = row_seq.data_ptr<int64_t>();
  const int64_t* positions = row_pos.data_ptr<int64_t>();
  int64_t max_len = 1, total_keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(seqs[t] >= 0 && seqs[t] < B && positions[t] >= 0 && positions[t] < K, "row ", t,
                " names a sequence or position outside context_slots");
    const int64_t first = window > 0 ? std::max<int64_t>(0, positions[t] - window + 1) : 0;
    for (int64_t j = first; j <= positions[t]; ++j)
      TORCH_CHECK(context[seqs[t] * K + j] >= 0 && context[seqs[t] * K + j] < num_slots,
                  "a context slot is outside the pool");
    max_len = std::max(max_len, positions[t] - first + 1);
    total_keys += positions[t] - first + 1;
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
  // ~1,024 keys of work per task at least: one thread for a short step, an even split of a long one.
  const int64_t grain = std::max<int64_t>(1, T * 1024 / std::max<int64_t>(1, total_keys));
  const float s = static_cast<float>(scale);
  const auto isa = static_cast<int>(attend_isa());  // an index into each kernel's variants
  using BF16 = c10::BFloat16;
  const bool fp32 = dtype == at::kFloat;
#define KVREUSE_RUN(FN, T_, R) \
  run<T_, R>(FN[isa], q, k_cache, v_cache, context, K, seqs, positions, window, max_len, s, out, grain)
  if (pool_dtype == at::kChar) {
    if (fp32) KVREUSE_RUN(prefill_fp32_int8, float, Int8Rows);
    else KVREUSE_RUN(prefill_bf16_int8, BF16, Int8Rows);
  } else if (pool_dtype == at::kByte) {
    if (fp32) KVREUSE_RUN(prefill_fp32_fp8, float, Fp8Rows);
    else KVREUSE_RUN(prefill_bf16_fp8, BF16, Fp8Rows);
  } else if (fp32) {
    KVREUSE_RUN(prefill_fp32, float, PlainRows<float>);
  } else {
    KVREUSE_RUN(prefill_bf16, BF16, PlainRows<BF16>);
  }
#undef KVREUSE_RUN
  return out.view({T, H * D});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvreuse_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor context_slots, Tensor row_seq, "
        "Tensor row_pos, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvreuse_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
