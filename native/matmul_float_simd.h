// Float-weight matmul (F32, F16, BF16, and Q4_K / Q5_K / Q6_K decoded to f32) over a vector traits type V. Include
// inside an anonymous namespace of the ISA's file, after its traits and ops_simd.h.
//
// One register-blocked dot-product kernel serves every M: MR activation rows x NR weight rows of accumulators,
// each accumulating kWidth lanes of partial products along K; per vector step it loads NR weight vectors
// (converted from f16 / bf16 on the fly) and MR activation vectors for MR x NR FMAs, and at the end one
// transposing reduction turns the accumulators into outputs. Decode streams NR weight rows side by side; prefill
// re-reads the tile's rows from L2 for every group of MR activation rows. K-quant rows are decoded to f32 once
// per NR rows and reused by all M rows. Nothing is packed.
//
// Every output is one FMA chain along K and one fixed reduction tree, whatever MR, NR or M: a row's result does
// not depend on the rows it shares the matmul with (batch invariance).

template <class V, int Type>
struct WeightRow {
  static inline typename V::F load(const uint8_t* row, int64_t k) {
    if (Type == kF16) return V::load_f16(reinterpret_cast<const uint16_t*>(row) + k);
    if (Type == kBF16) return V::load_bf16(reinterpret_cast<const uint16_t*>(row) + k);
    return V::load(reinterpret_cast<const float*>(row) + k);
  }
  static inline typename V::F load_partial(const uint8_t* row, int64_t k, int64_t n) {
    if (Type == kF16) return V::load_f16_partial(reinterpret_cast<const uint16_t*>(row) + k, n);
    if (Type == kBF16) return V::load_bf16_partial(reinterpret_cast<const uint16_t*>(row) + k, n);
    return V::load_partial(reinterpret_cast<const float*>(row) + k, n);
  }
};

constexpr bool is_k_quant(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// y[MR x NR] = x[MR rows] . w[NR rows]; rows past the tile's end are clamped to its last row (computed, not stored).
template <class V, int LoadType, int MR, int NR>
inline void float_dot_block(const float* x, int64_t ldx, const uint8_t* const* w, int64_t K, float* y, int64_t ldy,
                            int rows, int cols) {
  using F = typename V::F;
  constexpr int W = V::kWidth;
  F acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
  }
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    F wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = WeightRow<V, LoadType>::load(w[j], k);
    for (int i = 0; i < MR; ++i) {
      const F xv = V::load(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = V::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const int64_t n = K - k;
    F wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = WeightRow<V, LoadType>::load_partial(w[j], k, n);
    for (int i = 0; i < MR; ++i) {
      const F xv = V::load_partial(x + i * ldx + k, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = V::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  if (MR * NR == W) {
    // One transposing reduction for all MR x NR accumulators.
    float sums[W];
    V::store(sums, V::reduce_add_lanes(&acc[0][0]));
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < cols; ++j) y[i * ldy + j] = sums[i * NR + j];
    }
  } else {
    for (int i = 0; i < MR && i < rows; ++i) {
      for (int j = 0; j < NR && j < cols; ++j) y[i * ldy + j] = V::reduce_add(acc[i][j]);
    }
  }
}

template <class V, int Type, int MR, int NR>
void float_tile(const MatmulTile& t) {
  constexpr int LoadType = is_k_quant(Type) ? kF32 : Type;
  float* decoded = reinterpret_cast<float*>(t.scratch);
  for (int64_t n0 = t.n0; n0 < t.n1; n0 += NR) {
    const int cols = t.n1 - n0 < NR ? static_cast<int>(t.n1 - n0) : NR;
    const uint8_t* w[NR];
    for (int j = 0; j < NR; ++j) {
      const int64_t n = n0 + (j < cols ? j : cols - 1);
      if (is_k_quant(Type)) {
        float* row = decoded + j * t.K;
        if (j < cols) simd_dequantize_row<V>(Type, t.w + n * t.w_row_bytes, row, t.K);
        w[j] = reinterpret_cast<const uint8_t*>(j < cols ? row : decoded + (cols - 1) * t.K);
      } else {
        w[j] = t.w + n * t.w_row_bytes;
      }
    }
    int64_t m = 0;
    for (; m + MR <= t.M; m += MR) {
      float_dot_block<V, LoadType, MR, NR>(t.x + m * t.K, t.K, w, t.K, t.y + m * t.ldy + n0, t.ldy, MR, cols);
    }
    for (; m < t.M; ++m) {
      float_dot_block<V, LoadType, 1, NR>(t.x + m * t.K, t.K, w, t.K, t.y + m * t.ldy + n0, t.ldy, 1, cols);
    }
  }
}

// K-quant rows decoded for one block of NR rows (NR <= 4 in every variant).
inline size_t float_scratch_bytes(int64_t K) { return 4 * static_cast<size_t>(K) * sizeof(float) + 64; }
