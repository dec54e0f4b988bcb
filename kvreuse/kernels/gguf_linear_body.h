// The GGUF product's body, written once over a vector type V: gguf_linear.cpp includes this file once per
// instruction set, inside that set's target region and namespace, after defining V there (the AVX-512 V holds a
// panel's 16 rows in one vector, the AVX2 V in two 8-lane halves). Everything below therefore compiles for that
// set, and V's primitives inline into it.
//
// Every row of x takes one summation order whatever the row count T, so that a row's output never depends on what
// else is in its batch (prefix reuse computes a prompt's rows after a cached prefix, a cold run computes them all in
// one product; docs/design/batch-invariance.md): two sums per output, one over inputs 0-15 of every block and one
// over inputs 16-31, each in input order, added at the end. Both widths run the same order, so they give the same
// bits. Few rows dequantize in registers; more rows dequantize the panel once into a buffer [K, 16] that tiles of
// rows read in the same order.
//
// V provides: Vec and IVec (float and int32 lanes), kLanes (rows of a panel per vector), kPassRows (rows that
// dequantize in registers at once), kRegisterRows (rows that take such passes, not the dequantized panel),
// kTileRows (rows per tile over a dequantized panel), kPassUnroll and kTileUnroll (inner loop unrolling), and
// zero, load, load_half, store, store_first, broadcast, fmadd, add, widen_codes, low_nibbles, high_nibbles,
// to_float.

using Vec = V::Vec;
constexpr int kHalves = kPanel / V::kLanes;  // vectors across a panel's 16 rows

// A block's scales and mins for inputs 0-15 (d0, m0) and 16-31 (d1, m1), across one vector of a panel's rows.
struct BlockScales {
  Vec d0, m0, d1, m1;
};

// Scale or min vector i (of 2G) of the block at `record`, for the panel's rows in vector `half`.
template <bool Half>
inline Vec scales(const uint8_t* record, int i, int half) {
  if constexpr (Half) return V::load_half(record + 2 * (kPanel * i + V::kLanes * half));
  else return V::load(reinterpret_cast<const float*>(record) + kPanel * i + V::kLanes * half);
}

template <int G, bool Half>
inline BlockScales block_scales(const uint8_t* record, int half) {
  const Vec d0 = scales<Half>(record, 0, half), m0 = scales<Half>(record, G, half);
  return {d0, m0, G == 1 ? d0 : scales<Half>(record, 1, half), G == 1 ? m0 : scales<Half>(record, G + 1, half)};
}

// The weights of the panel's rows in vector `half` at inputs j (lo) and j + 16 (hi) of the block at `record`.
template <int Bits, int G, bool Half>
inline void weights(const uint8_t* record, const BlockScales& s, int j, int half, Vec& lo, Vec& hi) {
  const uint8_t* codes = record + 2 * G * kPanel * (Half ? 2 : 4) + V::kLanes * half;
  const auto q = V::widen_codes(codes + 16 * j);
  if constexpr (Bits == 4) {
    lo = V::fmadd(V::to_float(V::low_nibbles(q)), s.d0, s.m0);
    hi = V::fmadd(V::to_float(V::high_nibbles(q)), s.d1, s.m1);
  } else {
    lo = V::fmadd(V::to_float(q), s.d0, s.m0);
    hi = V::fmadd(V::to_float(V::widen_codes(codes + 16 * (j + 16))), s.d1, s.m1);
  }
}

// The panel's rows in vector `half` lie past the last output (the padded half of a last panel).
inline bool beyond(const Problem& p, int64_t panel, int half) { return panel * kPanel + V::kLanes * half >= p.N; }

template <int TR>
inline void store(const Problem& p, int64_t panel, int64_t t0, int half, const Vec (&acc)[2][TR]) {
  const int64_t n0 = panel * kPanel + V::kLanes * half, valid = std::min<int64_t>(V::kLanes, p.N - n0);
  for (int t = 0; t < TR; ++t) V::store_first(p.y + (t0 + t) * p.N + n0, V::add(acc[0][t], acc[1][t]), valid);
}

// One panel's rows in vector `half` against TR rows of x from t0, dequantizing in registers.
template <int Bits, int G, bool Half, int TR>
void pass(const Problem& p, int64_t panel, int64_t t0, int half) {
  constexpr int64_t kRecord = record_bytes(Bits, G, Half);
  const int64_t num_blocks = p.K / kBlock;
  if (beyond(p, panel, half)) return;
  const uint8_t* record = p.packed + panel * num_blocks * kRecord;
  const float* x = p.x + t0 * p.K;
  Vec acc[2][TR];
  for (int t = 0; t < TR; ++t) acc[0][t] = acc[1][t] = V::zero();
  for (int64_t b = 0; b < num_blocks; ++b, record += kRecord) {
    for (int64_t line = 0; line < kRecord; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + 4 * kRecord + line), _MM_HINT_T0);
    const float* xb = x + b * kBlock;
    const BlockScales s = block_scales<G, Half>(record, half);
#pragma GCC unroll V::kPassUnroll
    for (int j = 0; j < 16; ++j) {
      Vec lo, hi;
      weights<Bits, G, Half>(record, s, j, half, lo, hi);
      for (int t = 0; t < TR; ++t) {
        acc[0][t] = V::fmadd(lo, V::broadcast(xb + t * p.K + j), acc[0][t]);
        acc[1][t] = V::fmadd(hi, V::broadcast(xb + t * p.K + j + 16), acc[1][t]);
      }
    }
  }
  store<TR>(p, panel, t0, half, acc);
}

// The panel's weights, dequantized once: w[k * 16 + r] is W[panel * 16 + r, k].
template <int Bits, int G, bool Half>
void dequantize(const Problem& p, int64_t panel, float* w) {
  constexpr int64_t kRecord = record_bytes(Bits, G, Half);
  const uint8_t* record = p.packed + panel * (p.K / kBlock) * kRecord;
  for (int64_t b = 0; b < p.K / kBlock; ++b, record += kRecord, w += kBlock * kPanel) {
    for (int half = 0; half < kHalves; ++half) {
      const BlockScales s = block_scales<G, Half>(record, half);
      for (int j = 0; j < 16; ++j) {
        Vec lo, hi;
        weights<Bits, G, Half>(record, s, j, half, lo, hi);
        V::store(w + kPanel * j + V::kLanes * half, lo);
        V::store(w + kPanel * (j + 16) + V::kLanes * half, hi);
      }
    }
  }
}

// TR rows of x from t0 against the rows in vector `half` of a dequantized panel, in pass's order.
template <int TR>
void tile(const Problem& p, const float* w, int64_t panel, int64_t t0, int half) {
  if (beyond(p, panel, half)) return;
  const float* x = p.x + t0 * p.K;
  Vec acc[2][TR];
  for (int t = 0; t < TR; ++t) acc[0][t] = acc[1][t] = V::zero();
  w += V::kLanes * half;
  for (int64_t k = 0; k < p.K; k += kBlock) {
#pragma GCC unroll V::kTileUnroll
    for (int64_t j = k; j < k + 16; ++j) {
      const Vec w0 = V::load(w + kPanel * j), w1 = V::load(w + kPanel * (j + 16));
      for (int t = 0; t < TR; ++t) {
        acc[0][t] = V::fmadd(w0, V::broadcast(x + t * p.K + j), acc[0][t]);
        acc[1][t] = V::fmadd(w1, V::broadcast(x + t * p.K + j + 16), acc[1][t]);
      }
    }
  }
  store<TR>(p, panel, t0, half, acc);
}

// One instance per row count, so that the accumulators stay in registers.
template <int Bits, int G, bool Half, int... I>
void one_pass(const Problem& p, int64_t panel, int64_t t0, int half, std::integer_sequence<int, I...>) {
  const int64_t rows = std::min<int64_t>(V::kPassRows, p.T - t0);
  ((rows == I + 1 ? pass<Bits, G, Half, I + 1>(p, panel, t0, half) : void()), ...);
}

template <int... I>
void last_tile(const Problem& p, const float* w, int64_t panel, int64_t t0, int half,
               std::integer_sequence<int, I...>) {
  ((p.T - t0 == I + 1 ? tile<I + 1>(p, w, panel, t0, half) : void()), ...);
}

// Every row of x against one panel: up to kRegisterRows rows in passes of kPassRows that dequantize in registers;
// more rows in tiles of kTileRows, then fewer, over the panel dequantized once into `w` ([K, 16] floats).
template <int Bits, int G, bool Half>
void panel_rows(const Problem& p, int64_t panel, float* w) {
  if (p.T <= V::kRegisterRows) {
    for (int half = 0; half < kHalves; ++half)
      for (int64_t t0 = 0; t0 < p.T; t0 += V::kPassRows)
        one_pass<Bits, G, Half>(p, panel, t0, half, std::make_integer_sequence<int, V::kPassRows>{});
    return;
  }
  dequantize<Bits, G, Half>(p, panel, w);
  for (int half = 0; half < kHalves; ++half) {
    int64_t t0 = 0;
    for (; t0 + V::kTileRows <= p.T; t0 += V::kTileRows) tile<V::kTileRows>(p, w, panel, t0, half);
    last_tile(p, w, panel, t0, half, std::make_integer_sequence<int, V::kTileRows - 1>{});
  }
}
