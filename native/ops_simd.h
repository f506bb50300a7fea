// Row kernels written once over a vector traits type V (Avx2 or Avx512): RMSNorm, residual add, SwiGLU, GeGLU,
// softmax, RoPE, KV store, and row dequantization of the float types, Q8_0 and Q4_0. Include inside an anonymous
// namespace of the ISA's file, after its traits (see simd_avx512.h). Every loop handles its tail with masked
// loads and stores, so any length works and nothing past the row is touched.

// ---------------------------------------------------------------------------------------------------------------
// exp: Cody-Waite range reduction x = n ln2 + r, then a degree-6 polynomial for e^r on |r| <= ln2/2 (max relative
// error ~2 ulp). Inputs are clamped to [-87.3, 88]: e^-87.3 is the smallest normal float (what softmax and SiLU
// need there is "about zero"), and e^88 stays finite.
template <class V>
inline typename V::F vexp(typename V::F x) {
  using F = typename V::F;
  x = V::min(V::max(x, V::set1(-87.3f)), V::set1(88.0f));
  const F n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  F r = V::fmadd(n, V::set1(-0.693359375f), x);
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  F p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  p = V::fmadd(p, V::mul(r, r), V::add(r, V::set1(1.0f)));
  return V::mul(p, V::pow2i(n));
}

// ---------------------------------------------------------------------------------------------------------------
// Row ops

template <class V>
void simd_rmsnorm(const float* x, const float* weight, float* out, int64_t dim, float eps) {
  constexpr int W = V::kWidth;
  auto acc = V::zero();
  int64_t i = 0;
  for (; i + W <= dim; i += W) acc = V::fmadd(V::load(x + i), V::load(x + i), acc);
  if (i < dim) {
    const auto t = V::load_partial(x + i, dim - i);
    acc = V::fmadd(t, t, acc);
  }
  const float scale = 1.0f / std::sqrt(V::reduce_add(acc) / static_cast<float>(dim) + eps);
  const auto s = V::set1(scale);
  for (i = 0; i + W <= dim; i += W) V::store(out + i, V::mul(V::mul(V::load(x + i), s), V::load(weight + i)));
  if (i < dim) {
    const int64_t n = dim - i;
    V::store_partial(out + i, V::mul(V::mul(V::load_partial(x + i, n), s), V::load_partial(weight + i, n)), n);
  }
}

template <class V>
void simd_add(float* acc, const float* x, int64_t n) {
  constexpr int W = V::kWidth;
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store(acc + i, V::add(V::load(acc + i), V::load(x + i)));
  if (i < n) V::store_partial(acc + i, V::add(V::load_partial(acc + i, n - i), V::load_partial(x + i, n - i)), n - i);
}

template <class V>
inline typename V::F silu_times(typename V::F g, typename V::F u) {
  const auto one = V::set1(1.0f);
  return V::mul(V::div(g, V::add(one, vexp<V>(V::sub(V::zero(), g)))), u);
}

// out = act(gate) * up elementwise, full vectors then one partial one: the gated FFNs' shared loop.
template <class V, typename V::F (*Act)(typename V::F, typename V::F)>
void simd_gated(const float* gate, const float* up, float* out, int64_t n) {
  constexpr int W = V::kWidth;
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store(out + i, Act(V::load(gate + i), V::load(up + i)));
  if (i < n) V::store_partial(out + i, Act(V::load_partial(gate + i, n - i), V::load_partial(up + i, n - i)), n - i);
}

template <class V>
void simd_swiglu(const float* gate, const float* up, float* out, int64_t n) {
  simd_gated<V, silu_times<V>>(gate, up, out, n);
}

// GELU-tanh times up, as a sigmoid: g/2 (1 + tanh(z)) = g / (1 + e^(-2z)), z = sqrt(2/pi) (g + 0.044715 g^3). No
// cancellation where tanh(z) nears -1 (very negative g), and e^(-2z) clamped by vexp leaves g / (1 + e^88) there,
// which is the ~0 the exact value is.
template <class V>
inline typename V::F gelu_times(typename V::F g, typename V::F u) {
  const auto z2 = V::mul(V::mul(g, V::set1(-2.0f * 0.7978845608028654f)),
                         V::fmadd(V::mul(g, g), V::set1(0.044715f), V::set1(1.0f)));
  return V::mul(V::div(g, V::add(V::set1(1.0f), vexp<V>(z2))), u);
}

template <class V>
void simd_geglu(const float* gate, const float* up, float* out, int64_t n) {
  simd_gated<V, gelu_times<V>>(gate, up, out, n);
}

// x[0, n) <- exp(x - max), returning the max and the sum: the softmax without its normalisation (attention
// normalises once per row, after folding a row's chunks).
template <class V>
inline void exp_scores(float* x, int64_t n, float* max_out, float* sum_out) {
  constexpr int W = V::kWidth;
  auto vmax = V::set1(-INFINITY);
  int64_t i = 0;
  for (; i + W <= n; i += W) vmax = V::max(vmax, V::load(x + i));
  if (i < n) vmax = V::max(vmax, V::load_partial_or_neg_inf(x + i, n - i));
  const float m = V::reduce_max(vmax);
  const auto max = V::set1(m);
  auto vsum = V::zero();
  for (i = 0; i + W <= n; i += W) {
    const auto e = vexp<V>(V::sub(V::load(x + i), max));
    V::store(x + i, e);
    vsum = V::add(vsum, e);
  }
  if (i < n) {
    // Lanes past n load 0 and would add e^(0 - max): keep only the live lanes of the sum.
    const auto e = vexp<V>(V::sub(V::load_partial(x + i, n - i), max));
    V::store_partial(x + i, e, n - i);
    float tail[V::kWidth] = {};
    V::store_partial(tail, e, n - i);
    vsum = V::add(vsum, V::load(tail));
  }
  *max_out = m;
  *sum_out = V::reduce_add(vsum);
}

template <class V>
void simd_softmax(float* x, int64_t n) {
  constexpr int W = V::kWidth;
  float max, sum;
  exp_scores<V>(x, n, &max, &sum);
  const auto inv = V::set1(1.0f / sum);
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store(x + i, V::mul(V::load(x + i), inv));
  if (i < n) V::store_partial(x + i, V::mul(V::load_partial(x + i, n - i), inv), n - i);
}

// kernels.h's scale_row. The plain loop: compiled under each file's target, GCC vectorizes the widening, the
// product in double and the rounding back to float (one rounding each, as in JavaScript, in every lane).
template <class V>
void simd_scale_row(const float* x, float* out, int64_t n, double factor) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<double>(x[i]) * factor);
}

// The greedy token of a logits row: the largest value in one pass (four running maxima, so consecutive vectors do
// not wait on each other, and a NaN check on the same loads), then the first index holding it, in a second pass
// that stops there (the row is still in cache). -1 for a row with a NaN or nothing above -inf (kernels.h). Ties
// go to the lowest index as in the sampler's argmax: the second pass finds the first equal value, and -0 == +0.
template <class V>
int64_t simd_argmax(const float* x, int64_t n) {
  constexpr int W = V::kWidth;
  auto m0 = V::set1(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  unsigned nan = 0;
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    const auto a = V::load(x + i), b = V::load(x + i + W), c = V::load(x + i + 2 * W), d = V::load(x + i + 3 * W);
    nan |= V::unordered_bits(a, b) | V::unordered_bits(c, d);
    m0 = V::max(m0, a);
    m1 = V::max(m1, b);
    m2 = V::max(m2, c);
    m3 = V::max(m3, d);
  }
  for (; i < n; i += W) {
    const auto a = i + W <= n ? V::load(x + i) : V::load_partial_or_neg_inf(x + i, n - i);
    nan |= V::unordered_bits(a, a);
    m0 = V::max(m0, a);
  }
  const float best = V::reduce_max(V::max(V::max(m0, m1), V::max(m2, m3)));
  if (nan != 0 || !(best > -INFINITY)) return -1;
  const auto target = V::set1(best);
  for (i = 0; i < n; i += W) {
    const auto a = i + W <= n ? V::load(x + i) : V::load_partial_or_neg_inf(x + i, n - i);
    const unsigned hits = V::eq_bits(a, target);
    if (hits != 0) return i + __builtin_ctz(hits);
  }
  return -1;  // not reached: best came from the row
}

// A plain store for a whole vector: AVX2's masked store is slow on some CPUs (microcoded on AMD), so the masked
// form is kept for tails.
template <class V>
inline void store_maybe_partial(float* p, typename V::F v, int64_t n) {
  if (n == V::kWidth) {
    V::store(p, v);
  } else {
    V::store_partial(p, v, n);
  }
}

template <class V>
void simd_rope(float* x, const RopeParams& p, const float* cos, const float* sin) {
  constexpr int W = V::kWidth;
  const int half = p.rope_dim / 2;
  for (int h = 0; h < p.num_heads; ++h) {
    float* head = x + static_cast<int64_t>(h) * p.head_dim;
    if (p.neox) {
      // Pairs (i, i + half): two contiguous runs.
      for (int i = 0; i < half; i += W) {
        const int64_t n = half - i < W ? half - i : W;
        const auto c = V::load_partial(cos + i, n), s = V::load_partial(sin + i, n);
        const auto x0 = V::load_partial(head + i, n), x1 = V::load_partial(head + i + half, n);
        store_maybe_partial<V>(head + i, V::sub(V::mul(x0, c), V::mul(x1, s)), n);
        store_maybe_partial<V>(head + i + half, V::fmadd(x0, s, V::mul(x1, c)), n);
      }
    } else {
      // Pairs (2i, 2i+1): out = x * cos' + swap(x) * sin', cos' = {c, c}, sin' = {-s, s} per pair.
      for (int e = 0; e < p.rope_dim; e += W) {
        const int64_t n = p.rope_dim - e < W ? p.rope_dim - e : W;
        const auto c = V::dup_pairs(cos + e / 2, n / 2);
        const auto s = V::mul(V::dup_pairs(sin + e / 2, n / 2), V::even_negative());
        const auto v = V::load_partial(head + e, n);
        store_maybe_partial<V>(head + e, V::fmadd(V::swap_pairs(v), s, V::mul(v, c)), n);
      }
    }
  }
}

template <class V>
void simd_kv_store(const float* src, uint8_t* dst, int64_t n, bool f16) {
  if (!f16) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  constexpr int W = V::kWidth;
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store_f16(out + i, V::load(src + i));
  if (i < n) V::store_f16_partial(out + i, V::load_partial(src + i, n - i), n - i);
}

// ---------------------------------------------------------------------------------------------------------------
// Row dequantization

template <class V>
void simd_dequantize_f16(const uint8_t* src, float* dst, int64_t n) {
  constexpr int W = V::kWidth;
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store(dst + i, V::load_f16(h + i));
  if (i < n) V::store_partial(dst + i, V::load_f16_partial(h + i, n - i), n - i);
}

template <class V>
void simd_dequantize_bf16(const uint8_t* src, float* dst, int64_t n) {
  constexpr int W = V::kWidth;
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store(dst + i, V::load_bf16(h + i));
  if (i < n) V::store_partial(dst + i, V::load_bf16_partial(h + i, n - i), n - i);
}

template <class V>
void simd_dequantize_q8_0(const uint8_t* src, float* dst, int64_t n) {
  constexpr int W = V::kWidth;
  const BlockQ8_0* blocks = reinterpret_cast<const BlockQ8_0*>(src);
  for (int64_t b = 0; b < n / kQK8_0; ++b) {
    const auto d = V::set1(fp16_to_fp32(blocks[b].d));
    for (int i = 0; i < kQK8_0; i += W) V::store(dst + b * kQK8_0 + i, V::mul(d, V::load_i8(blocks[b].qs + i)));
  }
}

template <class V>
void simd_dequantize_q4_0(const uint8_t* src, float* dst, int64_t n) {
  constexpr int W = V::kWidth;
  const BlockQ4_0* blocks = reinterpret_cast<const BlockQ4_0*>(src);
  for (int64_t b = 0; b < n / kQK4_0; ++b) {
    int8_t q[kQK4_0];
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<int8_t>((blocks[b].qs[i] & 0xF) - 8);
      q[i + 16] = static_cast<int8_t>((blocks[b].qs[i] >> 4) - 8);
    }
    const auto d = V::set1(fp16_to_fp32(blocks[b].d));
    for (int i = 0; i < kQK4_0; i += W) V::store(dst + b * kQK4_0 + i, V::mul(d, V::load_i8(q + i)));
  }
}

// Q4_K and Q5_K: per group of 64, the low nibbles of 32 bytes are sub-block 2g, the high nibbles sub-block 2g+1;
// Q5_K adds a fifth bit per element (bit s of qh[l] for element l of sub-block s; k4_high_bits). value = d * scale
// * q - dmin * min, computed in the generic kernel's order.
template <class V, class Block>
void simd_dequantize_q4_q5_k(const uint8_t* src, float* dst, int64_t n) {
  constexpr int W = V::kWidth;
  const Block* blocks = reinterpret_cast<const Block*>(src);
  const auto low4 = V::set1_i(0xF), one = V::set1_i(1);
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const Block& blk = blocks[b];
    const uint8_t* qh = k4_high_bits(blk);  // null for Q4_K: known at compile time, the branch folds away
    const float d = fp16_to_fp32(blk.d), dmin = fp16_to_fp32(blk.dmin);
    float* out = dst + b * kQK_K;
    for (int g = 0; g < 4; ++g) {
      uint8_t sc_lo, m_lo, sc_hi, m_hi;
      q4k_scale_min(2 * g, blk.scales, &sc_lo, &m_lo);
      q4k_scale_min(2 * g + 1, blk.scales, &sc_hi, &m_hi);
      const auto d_lo = V::set1(d * sc_lo), min_lo = V::set1(dmin * m_lo);
      const auto d_hi = V::set1(d * sc_hi), min_hi = V::set1(dmin * m_hi);
      for (int i = 0; i < 32; i += W) {
        const auto q = V::load_u8(blk.qs + 32 * g + i);
        auto q_lo = V::and_i(q, low4), q_hi = V::srli_i(q, 4);
        if (qh) {
          const auto h = V::srli_i(V::load_u8(qh + i), 2 * g);
          q_lo = V::or_i(q_lo, V::slli_i(V::and_i(h, one), 4));
          q_hi = V::or_i(q_hi, V::slli_i(V::and_i(V::srli_i(h, 1), one), 4));
        }
        V::store(out + 64 * g + i, V::sub(V::mul(d_lo, V::to_float(q_lo)), min_lo));
        V::store(out + 64 * g + 32 + i, V::sub(V::mul(d_hi, V::to_float(q_hi)), min_hi));
      }
    }
  }
}

// Q6_K: element l + 32k of a half takes 4 bits from ql (nibble of byte l or l + 32) and 2 bits from qh[l] (pair
// k); value = d * (scale * (q - 32)) with the scale of its 16-element sub-block.
template <class V>
void simd_dequantize_q6_k(const uint8_t* src, float* dst, int64_t n) {
  constexpr int W = V::kWidth;
  const BlockQ6_K* blocks = reinterpret_cast<const BlockQ6_K*>(src);
  const auto low4 = V::set1_i(0xF), low2 = V::set1_i(3), bias = V::set1_i(32);
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const BlockQ6_K& blk = blocks[b];
    const auto d = V::set1(fp16_to_fp32(blk.d));
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = blk.ql + 64 * half;
      const uint8_t* qh = blk.qh + 32 * half;
      const int8_t* sc = blk.scales + 8 * half;
      float* out = dst + b * kQK_K + 128 * half;
      for (int l = 0; l < 32; l += W) {
        const int s = l / 16;
        const auto lo = V::load_u8(ql + l), hi = V::load_u8(ql + l + 32), h = V::load_u8(qh + l);
        const auto q1 = V::sub_i(V::or_i(V::and_i(lo, low4), V::slli_i(V::and_i(h, low2), 4)), bias);
        const auto q2 = V::sub_i(V::or_i(V::and_i(hi, low4), V::slli_i(V::and_i(V::srli_i(h, 2), low2), 4)), bias);
        const auto q3 = V::sub_i(V::or_i(V::srli_i(lo, 4), V::slli_i(V::and_i(V::srli_i(h, 4), low2), 4)), bias);
        const auto q4 = V::sub_i(V::or_i(V::srli_i(hi, 4), V::slli_i(V::srli_i(h, 6), 4)), bias);
        V::store(out + l, V::mul(d, V::to_float(V::mullo_i(V::set1_i(sc[s]), q1))));
        V::store(out + l + 32, V::mul(d, V::to_float(V::mullo_i(V::set1_i(sc[s + 2]), q2))));
        V::store(out + l + 64, V::mul(d, V::to_float(V::mullo_i(V::set1_i(sc[s + 4]), q3))));
        V::store(out + l + 96, V::mul(d, V::to_float(V::mullo_i(V::set1_i(sc[s + 6]), q4))));
      }
    }
  }
}

// The K-quant row decoders, by type (the matmul's float path decodes K-quant rows with these).
template <class V>
inline void simd_dequantize_row(int type, const uint8_t* src, float* dst, int64_t n) {
  if (type == kQ4_K) {
    simd_dequantize_q4_q5_k<V, BlockQ4_K>(src, dst, n);
  } else if (type == kQ5_K) {
    simd_dequantize_q4_q5_k<V, BlockQ5_K>(src, dst, n);
  } else {
    simd_dequantize_q6_k<V>(src, dst, n);
  }
}
