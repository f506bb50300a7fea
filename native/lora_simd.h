// LoRA down- and up-projection kernels written once over a vector traits type V (Avx2 or Avx512) and a storage type
// (LoraDtype: f32, bf16). Include inside an anonymous namespace of the ISA's file, after its traits (see simd_avx512.h).
//
// Down: every (row, k) dot product has its own accumulator vector, element i in lane i mod W, the tail through a
// zero-padded copy, the lanes summed by V::reduce_add: the same bits whatever the other rows or the thread.
// Up: vectorized across outputs, k ascending for each output: no reduction across lanes at all.

// f32 and bf16 only: q8 multiplies 8-bit activations and has kernels of its own (lora_q8_avx512.h, ops_generic.cc).
template <class V, int D>
inline typename V::F lora_load(const uint8_t* row, int64_t i) {
  static_assert(D == kLoraF32 || D == kLoraBF16, "q8 has kernels of its own");
  if constexpr (D == kLoraF32) return V::load(reinterpret_cast<const float*>(row) + i);
  else return V::load_bf16(reinterpret_cast<const uint16_t*>(row) + i);
}

// Elements [i, i + n) (n < W) of a row, zeros past them; nothing past the row is read.
template <class V, int D>
inline typename V::F lora_load_partial(const uint8_t* row, int64_t i, int64_t n) {
  if constexpr (D == kLoraF32) return V::load_partial(reinterpret_cast<const float*>(row) + i, n);
  else return V::load_bf16_partial(reinterpret_cast<const uint16_t*>(row) + i, n);
}

template <class V, int D>
void simd_lora_down(const LoraMatrixView& m, const float* x, int64_t ldx, const int32_t* rows, int64_t n, float* u) {
  constexpr int W = V::kWidth;
  constexpr int KB = 4;
  const int64_t in = m.in;
  const int64_t body = in - in % W;
  const size_t row_bytes = static_cast<size_t>(in) * lora_dtype_bytes(D);
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + static_cast<int64_t>(rows[r]) * ldx;
    for (int64_t k0 = 0; k0 < m.rank; k0 += KB) {
      const int kb = static_cast<int>(min64(KB, m.rank - k0));
      typename V::F acc[KB] = {V::zero(), V::zero(), V::zero(), V::zero()};
      const uint8_t* a[KB];
      for (int j = 0; j < kb; ++j) a[j] = m.a + (k0 + j) * row_bytes;
      for (int64_t i = 0; i < body; i += W) {
        const auto xv = V::load(xr + i);
        for (int j = 0; j < kb; ++j) acc[j] = V::fmadd(lora_load<V, D>(a[j], i), xv, acc[j]);
      }
      if (body < in) {
        const auto xv = V::load_partial(xr + body, in - body);
        for (int j = 0; j < kb; ++j) acc[j] = V::fmadd(lora_load_partial<V, D>(a[j], body, in - body), xv, acc[j]);
      }
      for (int j = 0; j < kb; ++j) u[r * m.rank + k0 + j] = m.a_scale[k0 + j] * V::reduce_add(acc[j]);
    }
  }
}

template <class V, int D>
void simd_lora_up(const LoraMatrixView& m, const float* u, const int32_t* rows, int64_t n, float scale, float* y,
                  int64_t ldy, int64_t o0, int64_t o1, float* scratch) {
  constexpr int W = V::kWidth;
  const int64_t width = o1 - o0;
  const int64_t body = width - width % W;
  float* factor = scratch + m.rank * kLoraUpChunk;
  const auto vscale = V::set1(scale);
  if (n <= 2) {
    // Few rows (a decode step's rows of one adapter): Bt converted in registers for each row. The same conversions
    // and the same adds in the same order as below, so the same bits.
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t k = 0; k < m.rank; ++k) factor[k] = m.bt_scale[k] * u[r * m.rank + k];
      float* yr = y + static_cast<int64_t>(rows[r]) * ldy + o0;
      for (int64_t j = 0; j < body; j += W) {
        auto acc = V::mul(lora_load<V, D>(m.bt, lora_bt_index(D, m.rank, 0, o0 + j)), V::set1(factor[0]));
        for (int64_t k = 1; k < m.rank; ++k) {
          acc = V::fmadd(lora_load<V, D>(m.bt, lora_bt_index(D, m.rank, k, o0 + j)), V::set1(factor[k]), acc);
        }
        V::store(yr + j, V::add(V::load(yr + j), V::mul(vscale, acc)));
      }
      if (body < width) {
        const int64_t lanes = width - body;
        auto acc = V::mul(lora_load_partial<V, D>(m.bt, lora_bt_index(D, m.rank, 0, o0 + body), lanes), V::set1(factor[0]));
        for (int64_t k = 1; k < m.rank; ++k) {
          acc = V::fmadd(lora_load_partial<V, D>(m.bt, lora_bt_index(D, m.rank, k, o0 + body), lanes), V::set1(factor[k]), acc);
        }
        V::store_partial(yr + body, V::add(V::load_partial(yr + body, lanes), V::mul(vscale, acc)), lanes);
      }
    }
    return;
  }
  // Bt[k][o0 .. o1) as f32, row k at scratch + k * kLoraUpChunk: converted once, read for every row.
  float* bt = scratch;
  for (int64_t k = 0; k < m.rank; ++k) {
    float* dst = bt + k * kLoraUpChunk;
    for (int64_t j = 0; j < body; j += W) V::store(dst + j, lora_load<V, D>(m.bt, lora_bt_index(D, m.rank, k, o0 + j)));
    if (body < width) {
      V::store_partial(dst + body, lora_load_partial<V, D>(m.bt, lora_bt_index(D, m.rank, k, o0 + body), width - body), width - body);
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < m.rank; ++k) factor[k] = m.bt_scale[k] * u[r * m.rank + k];
    float* yr = y + static_cast<int64_t>(rows[r]) * ldy + o0;
    for (int64_t j = 0; j < width; j += W) {
      if (j + W <= width) {
        auto acc = V::mul(V::load(bt + j), V::set1(factor[0]));
        for (int64_t k = 1; k < m.rank; ++k) acc = V::fmadd(V::load(bt + k * kLoraUpChunk + j), V::set1(factor[k]), acc);
        V::store(yr + j, V::add(V::load(yr + j), V::mul(vscale, acc)));
      } else {
        const int64_t lanes = width - j;
        auto acc = V::mul(V::load_partial(bt + j, lanes), V::set1(factor[0]));
        for (int64_t k = 1; k < m.rank; ++k) {
          acc = V::fmadd(V::load_partial(bt + k * kLoraUpChunk + j, lanes), V::set1(factor[k]), acc);
        }
        V::store_partial(yr + j, V::add(V::load_partial(yr + j, lanes), V::mul(vscale, acc)), lanes);
      }
    }
  }
}
