// Paged attention over a vector traits type V. Include inside an anonymous namespace of the ISA's file, after
// its traits and ops_simd.h (for vexp / simd_softmax).
//
// A unit is (sequence, KV head, rows). The pool offsets of its context positions are looked up in the block
// table once per unit and shared by K and V, every row and every query head of the group. Per row, whether it is
// part of a prefill chunk or a decode step:
//  - scores, kWidth positions at a time: each position's dot product is accumulated lane-parallel over
//    head_dim, then one transposing reduction turns kWidth accumulators into kWidth scores (a full horizontal
//    reduction per position would cost more than the dot product itself); K rows are reused by the group's
//    heads from L1, and the K and V rows a little further on are prefetched, since a decode step finds the
//    KV cache in DRAM (the weights streamed since the last step have evicted it);
//  - a vectorised softmax;
//  - out = P V with whole head outputs of several query vectors in registers, so each V row is read once for all
//    of them (head_dim of 1, 2, 4 or 8 vectors; other sizes go one vector chunk at a time).

template <class V, bool F16>
inline typename V::F load_kv(const uint8_t* row, int64_t d) {
  if (F16) return V::load_f16(reinterpret_cast<const uint16_t*>(row) + d);
  return V::load(reinterpret_cast<const float*>(row) + d);
}

template <class V, bool F16>
inline typename V::F load_kv_partial(const uint8_t* row, int64_t d, int64_t n) {
  if (F16) return V::load_f16_partial(reinterpret_cast<const uint16_t*>(row) + d, n);
  return V::load_partial(reinterpret_cast<const float*>(row) + d, n);
}

// Positions ahead whose K and V rows are prefetched.
constexpr int kAttentionPrefetchAhead = 64;

// Scores of the group's heads for positions [t0, t0 + live), live <= kWidth.
template <class V, bool F16>
inline void score_positions(const float* q, int group, int hd, const uint8_t* const* k, int live, float scale,
                            float* scores, size_t score_stride) {
  using F = typename V::F;
  constexpr int W = V::kWidth;
  const int full = hd / W * W;
  for (int j = 0; j < group; ++j) {
    F acc[W];
#pragma GCC unroll 16
    for (int u = 0; u < W; ++u) acc[u] = V::zero();
    for (int d = 0; d < full; d += W) {
      const F qv = V::load(q + j * hd + d);
#pragma GCC unroll 16
      for (int u = 0; u < W; ++u) acc[u] = V::fmadd(qv, load_kv<V, F16>(k[u], d), acc[u]);
    }
    if (full < hd) {
      const F qv = V::load_partial(q + j * hd + full, hd - full);
#pragma GCC unroll 16
      for (int u = 0; u < W; ++u) acc[u] = V::fmadd(qv, load_kv_partial<V, F16>(k[u], full, hd - full), acc[u]);
    }
    V::store_partial(scores + j * score_stride, V::mul(V::reduce_add_lanes(acc), V::set1(scale)), live);
  }
}

// Query vectors whose whole outputs (NC vectors each) one P V pass keeps in registers: about half the registers.
template <class V, int NC>
constexpr int value_block() {
  return (V::kWidth == 16 ? 16 : 8) / NC > 0 ? (V::kWidth == 16 ? 16 : 8) / NC : 1;
}

// out[i] = sum over positions t < context of p[i][t] * V[t] for n <= value_block query vectors at once, head_dim =
// NC vectors: every V row is read once for all of them.
template <class V, bool F16, int NC>
inline void weighted_values_block(const uint8_t* v_cache, const size_t* offsets, const float* p, size_t p_stride,
                                  int context, int n, float* const* out) {
  using F = typename V::F;
  constexpr int W = V::kWidth;
  constexpr int JB = value_block<V, NC>();
  F acc[JB][NC];
  const float* pj[JB];
  for (int j = 0; j < JB; ++j) {
    for (int c = 0; c < NC; ++c) acc[j][c] = V::zero();
    pj[j] = p + (j < n ? j : n - 1) * p_stride;
  }
  for (int t = 0; t < context; ++t) {
    const uint8_t* row = v_cache + offsets[t];
    F v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load_kv<V, F16>(row, c * W);
    for (int j = 0; j < JB; ++j) {
      const F pt = V::set1(pj[j][t]);
      for (int c = 0; c < NC; ++c) acc[j][c] = V::fmadd(pt, v[c], acc[j][c]);
    }
  }
  for (int j = 0; j < n; ++j) {
    for (int c = 0; c < NC; ++c) V::store(out[j] + c * W, acc[j][c]);
  }
}

// Any head_dim: one vector chunk of one head at a time, four positions in flight.
template <class V, bool F16>
inline void weighted_values_chunked(const uint8_t* v_cache, const size_t* offsets, const float* p, int context,
                                    int hd, float* out) {
  using F = typename V::F;
  constexpr int W = V::kWidth;
  for (int d = 0; d < hd; d += W) {
    const int64_t n = hd - d < W ? hd - d : W;
    F acc0 = V::zero(), acc1 = V::zero(), acc2 = V::zero(), acc3 = V::zero();
    int t = 0;
    if (n == W) {
      for (; t + 4 <= context; t += 4) {
        acc0 = V::fmadd(V::set1(p[t]), load_kv<V, F16>(v_cache + offsets[t], d), acc0);
        acc1 = V::fmadd(V::set1(p[t + 1]), load_kv<V, F16>(v_cache + offsets[t + 1], d), acc1);
        acc2 = V::fmadd(V::set1(p[t + 2]), load_kv<V, F16>(v_cache + offsets[t + 2], d), acc2);
        acc3 = V::fmadd(V::set1(p[t + 3]), load_kv<V, F16>(v_cache + offsets[t + 3], d), acc3);
      }
    }
    for (; t < context; ++t) acc0 = V::fmadd(V::set1(p[t]), load_kv_partial<V, F16>(v_cache + offsets[t], d, n), acc0);
    V::store_partial(out + d, V::add(V::add(acc0, acc1), V::add(acc2, acc3)), n);
  }
}

// The group's heads of one row: whole outputs in registers when head_dim is 1, 2, 4 or 8 vectors.
template <class V, bool F16>
inline void weighted_values(const AttentionArgs& a, const size_t* offsets, const float* scores, size_t score_stride,
                            int context, int group, int hd, float* out) {
  constexpr int W = V::kWidth;
  auto blocks = [&](auto chunks) {
    constexpr int NC = decltype(chunks)::value;
    constexpr int JB = value_block<V, NC>();
    for (int j0 = 0; j0 < group; j0 += JB) {
      const int n = group - j0 < JB ? group - j0 : JB;
      float* outs[JB];
      for (int j = 0; j < n; ++j) outs[j] = out + (j0 + j) * hd;
      weighted_values_block<V, F16, NC>(a.v_cache, offsets, scores + j0 * score_stride, score_stride, context, n, outs);
    }
  };
  switch (hd % W == 0 ? hd / W : 0) {
    case 1: return blocks(std::integral_constant<int, 1>());
    case 2: return blocks(std::integral_constant<int, 2>());
    case 4: return blocks(std::integral_constant<int, 4>());
    case 8: return blocks(std::integral_constant<int, 8>());
    default:
      for (int j = 0; j < group; ++j) {
        weighted_values_chunked<V, F16>(a.v_cache, offsets, scores + j * score_stride, context, hd, out + j * hd);
      }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Every row alone: a prefill row and a decode row go through the same arithmetic, so a sequence's outputs do not
// depend on how its prompt was chunked or what else is in the batch (batch invariance). (Treating a prefill
// chunk's rows as a small matrix, with keys transposed once per block, saved about a fifth of the score work but
// gave prefill rows different roundings than decode rows.)

template <class V, bool F16>
void attention_rows(const AttentionArgs& a, int kv_head, int first_row, int cached, int row_begin, int row_end,
                    const size_t* offsets, float* scores, size_t score_stride) {
  constexpr int W = V::kWidth;
  const int group = a.num_heads / a.num_kv_heads;
  const int hd = a.head_dim;
  const int64_t q_stride = static_cast<int64_t>(a.num_heads) * hd;
  const size_t row_span = static_cast<size_t>(hd) * (F16 ? 2 : 4);
  auto prefetch_row = [&](const uint8_t* row) {
    for (size_t off = 0; off < row_span; off += 64) _mm_prefetch(reinterpret_cast<const char*>(row + off), _MM_HINT_T0);
  };
  for (int r = row_begin; r < row_end; ++r) {
    const int context = cached + r + 1;
    const int64_t token = first_row + r;
    const float* q = a.q + token * q_stride + static_cast<int64_t>(kv_head) * group * hd;
    for (int t0 = 0; t0 < context; t0 += W) {
      const int live = context - t0 < W ? context - t0 : W;
      const uint8_t* k[W];
      for (int u = 0; u < W; ++u) k[u] = a.k_cache + offsets[t0 + (u < live ? u : live - 1)];
      for (int t = t0 + kAttentionPrefetchAhead; t < t0 + kAttentionPrefetchAhead + W && t < context; ++t) {
        prefetch_row(a.k_cache + offsets[t]);
        prefetch_row(a.v_cache + offsets[t - kAttentionPrefetchAhead]);
      }
      score_positions<V, F16>(q, group, hd, k, live, a.scale, scores + t0, score_stride);
    }
    for (int j = 0; j < group; ++j) simd_softmax<V>(scores + j * score_stride, context);
    weighted_values<V, F16>(a, offsets, scores, score_stride, context, group, hd,
                            a.out + token * q_stride + static_cast<int64_t>(kv_head) * group * hd);
  }
}

template <class V, bool F16>
void attention_unit(const AttentionArgs& a, int seq, int kv_head, int row_begin, int row_end, float* scratch) {
  const int group = a.num_heads / a.num_kv_heads;
  const int hd = a.head_dim;
  const int first_row = a.query_start_loc[seq];
  const int num_new = a.query_start_loc[seq + 1] - first_row;
  const int cached = a.seq_lens[seq] - num_new;
  const int max_context = cached + row_end;
  const int32_t* block_table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const size_t element = F16 ? 2 : 4;
  const size_t row_bytes = static_cast<size_t>(a.num_kv_heads) * hd * element;
  const size_t head_offset = static_cast<size_t>(kv_head) * hd * element;

  // Scratch: scores [group][score_stride], then the byte offset of each position's row.
  const size_t score_stride = attention_score_stride(max_context);
  float* scores = scratch;
  size_t* offsets = reinterpret_cast<size_t*>(scratch + static_cast<size_t>(group) * score_stride);
  // Block by block: no integer division per position (tens of cycles each, for every position of every unit of
  // every layer of a decode step).
  for (int t0 = 0, blk = 0; t0 < max_context; t0 += a.block_size, ++blk) {
    const size_t first = static_cast<size_t>(block_table[blk]) * a.block_size * row_bytes + head_offset;
    const int end = max_context - t0 < a.block_size ? max_context - t0 : a.block_size;
    for (int i = 0; i < end; ++i) offsets[t0 + i] = first + static_cast<size_t>(i) * row_bytes;
  }
  attention_rows<V, F16>(a, kv_head, first_row, cached, row_begin, row_end, offsets, scores, score_stride);
}

template <class V>
void simd_attention(const AttentionArgs& a, int seq, int kv_head, int row_begin, int row_end, float* scratch) {
  if (a.kv_f16) {
    attention_unit<V, true>(a, seq, kv_head, row_begin, row_end, scratch);
  } else {
    attention_unit<V, false>(a, seq, kv_head, row_begin, row_end, scratch);
  }
}
