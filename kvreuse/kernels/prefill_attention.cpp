// One layer's attention for a forward's query rows (prompt rows, and decode rows that ride along with them) over the
// paged pool, each row computed as if alone: its G query heads against its visible keys (0 .. its position, or the
// last `window` of them), in the one order attend_row gives (at head_dim 256 a tile of rows shares each key it loads,
// each row's arithmetic unchanged). A row's numbers therefore do not depend on how many query
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

// The query rows' tiles in an order whose halves (and quarters, roughly) hold equal work: tile n / 2 for even n, tile
// N - 1 - n / 2 for odd n, so a thread's contiguous share of tasks pairs a short causal tile with a long one.
inline int64_t balanced_tile(int64_t n, int64_t N) { return n % 2 == 0 ? n / 2 : N - 1 - n / 2; }

// ---- Tiles: a few rows of one sequence over one KV head, each key and value row loaded once for all of them ----
// A tile's query heads (its rows' G heads each, ~kTileHeads in all) read each key and value row it loads and converts
// (from bf16, int8, fp8), instead of each row loading it again. Every score and output element is still computed by
// attend_group_wide's operations for that row alone, in its order: a key's dot product is a function of the query
// head and the key only (its 16 lanes folded by the same fold16 tree, wherever the key sits in its block of 16), a
// row's softmax runs over its own scores (exp_and_sum over its own length), and its outputs sum its own keys' weighted
// values in key order. Rows of different lengths share a tile: each uses only the keys in its own range. Tiles run at
// head_dim 256 (Gemma 3), where one query head's row fills the registers and attend_row loaded each key once per head:
// a 2,048-row global layer took 72 ms instead of 145 (fp32). At head_dim 64 attend_row already reads a key once for a
// row's heads, and was faster than the tiles (45 ms against 69 for SmolLM2's layer), so rows there go alone.
constexpr int64_t kTileHeads = 12;
// The value loop's register block: up to kBlockHeads query heads' accumulators of kChunk vectors (one group of 32
// values: one scale in an 8-bit row) beside the chunk's values.
constexpr int kBlockHeads = 12, kChunk = 2;

inline int64_t tile_rows(int64_t G) { return std::max<int64_t>(1, kTileHeads / G); }

// Per-thread scratch of a tile of up to `rows` rows, G query heads each (query head e = row * G + head).
struct TileScratch {
  std::vector<float> q;         // [rows * G, D] in fp32
  std::vector<c10::BFloat16> q16;  // [rows * G, D]: q again, for the bf16 pairs (kDot)
  std::vector<float> scores;    // [rows * G, max_len]: a row's heads' scores at its key index (key - first)
  std::vector<float> blocks;    // room for `partial`, 64-byte aligned (a vector of V16 need not be)
  std::vector<float> totals;    // [rows * G] softmax denominators
  std::vector<float> out;       // [rows * G, D] in fp32
  std::vector<int64_t> first;   // [rows] each row's first key (a sequence position)
  std::vector<int64_t> last;    // [rows] and its last: its own position
  int64_t max_len;
  Scratch row;                  // attend_row's, for a head_dim other than 256
  TileScratch(int64_t rows, int64_t G, int64_t max_len, int64_t D)
      : q(rows * G * D), q16(rows * G * D), scores(rows * G * max_len), blocks(rows * G * 16 * 16 + 16),
        totals(rows * G), out(rows * G * D), first(rows), last(rows), max_len(max_len), row(G, max_len, D) {}
  // [rows * G, 16]: a block of 16 keys' dot products before fold16
  V16* partial() {
    return reinterpret_cast<V16*>((reinterpret_cast<uintptr_t>(blocks.data()) + 63) & ~uintptr_t{63});
  }
};

// The value loop's step: key k's values c * 16 .. (c + kChunk) * 16 - 1, loaded once, weighted into the nb heads'
// accumulators acc (head b's weight for key k at weights[b][k]) as attend_group_wide adds them. kChecked: skip the
// heads whose keys from[b] .. to[b] do not hold k (every head holds it otherwise).
template <typename R, int NV, bool kChecked>
__attribute__((always_inline)) inline void add_values(const Pool<R>& pool, const typename R::Code* vc,
                                                      const int64_t* ctx, int64_t k, int64_t hi, int c, int64_t nb,
                                                      const int64_t* from, const int64_t* to,
                                                      const float* const* weights, V16 (&acc)[kBlockHeads][kChunk]) {
  constexpr bool kScaled = R::kMaxCode != 0.f;
  if (k + kAheadWide <= hi) prefetch_row(vc + ctx[k + kAheadWide] * pool.stride + c * 16, kChunk * 16);
  const typename R::Code* row = vc + ctx[k] * pool.stride;
  V16 x[kChunk];
  for (int i = 0; i < kChunk; ++i) x[i] = load16<R>(row, c + i);
  const float gs = kScaled ? half_value(reinterpret_cast<const char*>(row + NV * 16) + c) : 1.f;  // group c / 2
  for (int b = 0; b < kBlockHeads; ++b) {
    if (b >= nb) break;
    if (kChecked && (k < from[b] || k > to[b])) continue;
    const float p = weights[b][k];
    const float w = kScaled ? p * gs : p;
    for (int i = 0; i < kChunk; ++i) acc[b][i] += w * x[i];
  }
}

// A tile's `rows` rows (G query heads each, in s.q) over the keys ctx[s.first[r] .. s.last[r]] of the KV head at
// `offset`: their outputs in s.out, for D = NV * 16. ctx is the tile's sequence's context slots by position.
template <typename R, int NV, bool kDot>
__attribute__((always_inline)) inline void attend_tile(const Pool<R>& pool, const int64_t* ctx, int64_t rows,
                                                       int64_t offset, int64_t G, float scale, TileScratch& s) {
  constexpr int64_t D = NV * 16;
  constexpr bool kScaled = R::kMaxCode != 0.f;
  const typename R::Code* kc = pool.k + offset;
  const typename R::Code* vc = pool.v + offset;
  const int64_t heads = rows * G;
  const int64_t* first = s.first.data();
  const int64_t* last = s.last.data();
  V16* const partials = s.partial();
  const int64_t lo = *std::min_element(first, first + rows), hi = *std::max_element(last, last + rows);
  if constexpr (kDot)
    for (int64_t e = 0; e < heads * D; ++e) s.q16[e] = static_cast<c10::BFloat16>(s.q[e]);  // exact: bf16 values
  // Scores, 16 keys at a time: each key's row loaded once, dotted with every head whose row reads it.
  for (int64_t k0 = lo; k0 <= hi; k0 += 16) {
    const int64_t n = std::min<int64_t>(16, hi + 1 - k0);
    for (int64_t jj = 0; jj < 16; ++jj) {
      V16* partial = partials + jj;  // head e's key jj at partial[e * 16]
      if (jj >= n) {
        for (int64_t e = 0; e < heads; ++e) partial[e * 16] = V16{};
        continue;
      }
      const int64_t k = k0 + jj;
      if (k + kAheadWide <= hi) prefetch_row(kc + ctx[k + kAheadWide] * pool.stride, pool.width);
      const typename R::Code* row = kc + ctx[k] * pool.stride;
      if constexpr (kDot) {
        Bf16Pairs x[NV / 2];
        for (int gi = 0; gi < NV / 2; ++gi) x[gi] = load_pairs(row, gi);
        for (int64_t r = 0; r < rows; ++r) {
          const bool reads = k >= first[r] && k <= last[r];
          for (int64_t e = r * G; e < (r + 1) * G; ++e) {
            if (!reads) {
              partial[e * 16] = V16{};
              continue;
            }
            Bf16Pairs q[NV / 2];
            for (int gi = 0; gi < NV / 2; ++gi) q[gi] = load_pairs(s.q16.data() + e * D, gi);
            partial[e * 16] = dot_pairs<NV / 2>(q, x);
          }
        }
        continue;
      }
      V16 x[NV];
      for (int i = 0; i < NV; ++i) x[i] = load16<R>(row, i);
      float gs[NV / 2];
      group_scales<R, NV>(row, gs);
      for (int64_t r = 0; r < rows; ++r) {
        const bool reads = k >= first[r] && k <= last[r];
        for (int64_t e = r * G; e < (r + 1) * G; ++e) {
          V16 total{};
          if (reads) {
            const float* q = s.q.data() + e * D;
            for (int gi = 0; gi < NV / 2; ++gi) {
              V16 q0, q1;
              std::memcpy(&q0, q + 32 * gi, sizeof(V16));
              std::memcpy(&q1, q + 32 * gi + 16, sizeof(V16));
              const V16 dot = q0 * x[2 * gi] + q1 * x[2 * gi + 1];
              total = kScaled ? total + dot * gs[gi] : total + dot;
            }
          }
          partial[e * 16] = total;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = r * G; e < (r + 1) * G; ++e) {
        const V16 sums = fold16(partials + e * 16) * scale;
        float lanes[16];
        std::memcpy(lanes, &sums, sizeof(lanes));
        float* to = s.scores.data() + e * s.max_len - first[r];  // key k's score at to[k]
        for (int64_t k = std::max(k0, first[r]); k < std::min(k0 + n, last[r] + 1); ++k) to[k] = lanes[k - k0];
      }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = r * G; e < (r + 1) * G; ++e)
      s.totals[e] = exp_and_sum(s.scores.data() + e * s.max_len, last[r] - first[r] + 1);
  // Outputs, kChunk vectors of each head at a time, kBlockHeads heads at a time: accumulators in registers, each key's
  // values of the chunk loaded once for the block.
  for (int c = 0; c < NV; c += kChunk) {
    for (int64_t e0 = 0; e0 < heads; e0 += kBlockHeads) {
      const int64_t nb = std::min<int64_t>(kBlockHeads, heads - e0);
      // head e0 + b reads keys from[b] .. to[b], its weight for key k at weights[b][k]
      int64_t from[kBlockHeads], to[kBlockHeads];
      const float* weights[kBlockHeads];
      for (int b = 0; b < nb; ++b) {
        const int64_t r = (e0 + b) / G;
        from[b] = first[r];
        to[b] = last[r];
        weights[b] = s.scores.data() + (e0 + b) * s.max_len - first[r];
      }
      const int64_t lo_k = *std::min_element(from, from + nb), hi_k = *std::max_element(to, to + nb);
      V16 acc[kBlockHeads][kChunk];
      for (int b = 0; b < kBlockHeads; ++b)
        for (int i = 0; i < kChunk; ++i) acc[b][i] = V16{};
      // keys in order: those only some of the block's heads read (checked), those all read, then the rest checked
      const int64_t all_from = *std::max_element(from, from + nb), all_to = *std::min_element(to, to + nb);
      for (int64_t k = lo_k; k < std::min(all_from, hi_k + 1); ++k)
        add_values<R, NV, true>(pool, vc, ctx, k, hi_k, c, nb, from, to, weights, acc);
      for (int64_t k = all_from; k <= all_to; ++k)
        add_values<R, NV, false>(pool, vc, ctx, k, hi_k, c, nb, from, to, weights, acc);
      for (int64_t k = std::max(all_from, all_to + 1); k <= hi_k; ++k)
        add_values<R, NV, true>(pool, vc, ctx, k, hi_k, c, nb, from, to, weights, acc);
      for (int b = 0; b < kBlockHeads; ++b) {
        if (b >= nb) break;
        const float inverse = 1.f / s.totals[e0 + b];
        for (int i = 0; i < kChunk; ++i) {
          const V16 o = acc[b][i] * inverse;
          std::memcpy(s.out.data() + (e0 + b) * D + (c + i) * 16, &o, sizeof(V16));
        }
      }
    }
  }
}

// Tasks [begin, end) of num_tiles * Hkv (tile, KV head) pairs; tile i holds rows tiles[i] .. tiles[i + 1] - 1, of one
// sequence. q, out [T, H, D] in T_; row t of sequence row_seq[t] at position row_pos[t] reads context slots
// [first, row_pos[t]] of its sequence's row of `context` [B, K].
template <typename T_, typename R, bool kDot>
__attribute__((always_inline)) inline void prefill_range(const T_* q, const Pool<R>& pool, const int64_t* context,
                                                         int64_t K, const int64_t* row_seq, const int64_t* row_pos,
                                                         int64_t window, const int64_t* tiles, int64_t num_tiles,
                                                         int64_t Hkv, int64_t G, int64_t D, float scale, T_* out,
                                                         int64_t begin, int64_t end, TileScratch& s) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t tile = balanced_tile(i / Hkv, num_tiles), h = i % Hkv;
    const int64_t t0 = tiles[tile], rows = tiles[tile + 1] - t0;
    const int64_t* ctx = context + row_seq[t0] * K;
    for (int64_t r = 0; r < rows; ++r) {
      s.last[r] = row_pos[t0 + r];
      s.first[r] = window > 0 ? std::max<int64_t>(0, s.last[r] - window + 1) : 0;
    }
    const int64_t at = (t0 * Hkv + h) * G * D;  // row t0's G query heads of KV head h; row t0 + r's at + r * H * D
    if (D != 256) {  // rows alone (see the tiles' header)
      for (int64_t r = 0; r < rows; ++r)
        attend_row<T_, R, kDot>(q + at + r * Hkv * G * D, pool, ctx + s.first[r], s.last[r] - s.first[r] + 1,
                                h * pool.width, G, D, scale, out + at + r * Hkv * G * D, s.row);
      continue;
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < G * D; ++e) s.q[r * G * D + e] = static_cast<float>(q[at + r * Hkv * G * D + e]);
    attend_tile<R, 16, kDot>(pool, ctx, rows, h * pool.width, G, scale, s);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < G * D; ++e) out[at + r * Hkv * G * D + e] = static_cast<T_>(s.out[r * G * D + e]);
  }
}

template <typename T_, typename R>
using PrefillFn = void (*)(const T_*, const Pool<R>&, const int64_t*, int64_t, const int64_t*, const int64_t*,
                           int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, float, T_*, int64_t, int64_t,
                           TileScratch&);

// Each compiled for AVX-512, AVX2 + FMA + F16C, and no extension, as the decode kernel's variants are: a row gets the
// same code in either kernel for the instruction set both pick (attend_isa), and a bf16 pool's AVX-512 BF16 variant
// where both pick it (attend_dot).
#define KVREUSE_PREFILL_VARIANT(NAME, TARGET, T_, R, DOT)                                                           \
  TARGET void NAME(const T_* q, const Pool<R>& pool, const int64_t* context, int64_t K, const int64_t* row_seq,     \
                   const int64_t* row_pos, int64_t window, const int64_t* tiles, int64_t num_tiles, int64_t Hkv,    \
                   int64_t G, int64_t D, float scale, T_* out, int64_t begin, int64_t end, TileScratch& s) {        \
    prefill_range<T_, R, DOT>(q, pool, context, K, row_seq, row_pos, window, tiles, num_tiles, Hkv, G, D, scale,    \
                              out, begin, end, s);                                                                  \
  }
#define KVREUSE_PREFILL_RANGE(NAME, T_, R)                                                                           \
  KVREUSE_PREFILL_VARIANT(NAME##_avx512, __attribute__((target(KVREUSE_AVX512))), T_, R, false)                      \
  KVREUSE_PREFILL_VARIANT(NAME##_avx2, __attribute__((target("avx2,fma,f16c"))), T_, R, false)                       \
  KVREUSE_PREFILL_VARIANT(NAME##_default, , T_, R, false)                                                            \
  const PrefillFn<T_, R> NAME[3] = {NAME##_default, NAME##_avx2, NAME##_avx512};
KVREUSE_PREFILL_RANGE(prefill_fp32, float, PlainRows<float>)
KVREUSE_PREFILL_RANGE(prefill_bf16, c10::BFloat16, PlainRows<c10::BFloat16>)
KVREUSE_PREFILL_RANGE(prefill_fp32_bf16, float, PlainRows<c10::BFloat16>)
KVREUSE_PREFILL_RANGE(prefill_fp32_int8, float, Int8Rows)
KVREUSE_PREFILL_RANGE(prefill_bf16_int8, c10::BFloat16, Int8Rows)
KVREUSE_PREFILL_RANGE(prefill_fp32_fp8, float, Fp8Rows)
KVREUSE_PREFILL_RANGE(prefill_bf16_fp8, c10::BFloat16, Fp8Rows)
KVREUSE_PREFILL_VARIANT(prefill_bf16_dot, __attribute__((target(KVREUSE_AVX512 ",avx512bf16"))), c10::BFloat16,
                        PlainRows<c10::BFloat16>, true)
#undef KVREUSE_PREFILL_RANGE
#undef KVREUSE_PREFILL_VARIANT

template <typename T_, typename R>
void run(PrefillFn<T_, R> fn, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const int64_t* context, int64_t K, const int64_t* row_seq, const int64_t* row_pos, int64_t window,
         int64_t max_len, int64_t total_keys, float scale, at::Tensor& out) {
  using Code = typename R::Code;
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), width = k_cache.size(3);
  const Pool<R> pool{static_cast<const Code*>(k_cache.data_ptr()), static_cast<const Code*>(v_cache.data_ptr()),
                     Hkv * width, width, R::kMaxCode == 0.f ? D : group_size(D)};
  const T_* qp = q.data_ptr<T_>();
  T_* op = out.data_ptr<T_>();
  // The tiles: runs of up to tile_rows(G) consecutive rows of one sequence, tile i from row tiles[i].
  const int64_t G = H / Hkv, most = tile_rows(G);
  std::vector<int64_t> tiles{0};
  for (int64_t t = 1; t < T; ++t)
    if (row_seq[t] != row_seq[tiles.back()] || t - tiles.back() == most) tiles.push_back(t);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  tiles.push_back(T);
  // ~1,024 keys of work per task at least: one thread for a short step, an even split of a long one.
  const int64_t grain = std::max<int64_t>(1, num_tiles * 1024 / std::max<int64_t>(1, total_keys));
  at::parallel_for(0, num_tiles * Hkv, grain, [&](int64_t begin, int64_t end) {
    TileScratch scratch(most, G, max_len, D);
    fn(qp, pool, context, K, row_seq, row_pos, window, tiles.data(), num_tiles, Hkv, G, D, scale, op, begin, end,
       scratch);
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
  TORCH_CHECK(pool_dtype == dtype || quantized || (pool_dtype == at::kBFloat16 && dtype == at::kFloat),
              "the caches must hold q's dtype, bf16 rows (under fp32 queries), int8 or fp8 (uint8) rows");
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
  const float s = static_cast<float>(scale);
  const auto isa = static_cast<int>(attend_isa());  // an index into each kernel's variants
  using BF16 = c10::BFloat16;
  const bool fp32 = dtype == at::kFloat;
#define KVREUSE_RUN(FN, T_, R) \
  run<T_, R>(FN[isa], q, k_cache, v_cache, context, K, seqs, positions, window, max_len, total_keys, s, out)
  if (pool_dtype == at::kChar) {
    if (fp32) KVREUSE_RUN(prefill_fp32_int8, float, Int8Rows);
    else KVREUSE_RUN(prefill_bf16_int8, BF16, Int8Rows);
  } else if (pool_dtype == at::kByte) {
    if (fp32) KVREUSE_RUN(prefill_fp32_fp8, float, Fp8Rows);
    else KVREUSE_RUN(prefill_bf16_fp8, BF16, Fp8Rows);
  } else if (pool_dtype == at::kFloat) {
    KVREUSE_RUN(prefill_fp32, float, PlainRows<float>);
  } else if (fp32) {  // fp32 queries over bf16 rows: no bf16 pairs, a query is not a bf16 value
    KVREUSE_RUN(prefill_fp32_bf16, float, PlainRows<BF16>);
  } else {
    run<BF16, PlainRows<BF16>>(attend_dot() ? prefill_bf16_dot : prefill_bf16[isa], q, k_cache, v_cache, context, K,
                               seqs, positions, window, max_len, total_keys, s, out);
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
