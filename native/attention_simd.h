// Paged attention over a vector traits type V. Include inside an anonymous namespace of the ISA's file, after
// its traits and ops_simd.h (for vexp).
//
// Split-K over fixed chunks of kAttentionChunk positions (kernels.h): a unit is (sequence, up to
// kAttentionRowsPerUnit rows, one chunk or all of them, every KV head), so a thread streams whole K and V rows of
// its chunk. The pool offsets of a chunk's positions are looked up in the block table once and shared by K and V,
// every row and every head. Per row and chunk, whether the row is part of a prefill chunk or a decode step:
//  - scores, kWidth positions at a time for every KV head: each position's dot product is accumulated
//    lane-parallel over head_dim, then one transposing reduction turns kWidth accumulators into kWidth scores (a
//    full horizontal reduction per position would cost more than the dot product itself); f16 keys are widened
//    once for the group's heads; the chunk's V rows are requested meanwhile;
//  - exponentials against the chunk's max, and their sum (no normalisation yet);
//  - P V with whole head outputs of several query vectors in registers, so each V row is read once for all of
//    them (head_dim of 1, 2, 4 or 8 vectors; other sizes go one vector chunk at a time).
// A row's chunks are then folded in order 0, 1, 2 ... (rescaling to the larger max) and normalised once.

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

// Largest head_dim whose f16 keys are widened to f32 once per kWidth positions for all heads of a group.
constexpr int kAttentionConvertMaxDim = 256;

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

// Scores of SUB (1-3) query heads sharing one KV head for 8 positions, with 16-lane vectors (SUB x 8 accumulators
// fit the 32 registers): each K vector is loaded, and widened from f16, once for all SUB heads, then one reduction
// per head turns its 8 accumulators into 8 scores. The FMAs of each score are score_positions' in the same order,
// and the reduction adds in reduce_add's order like reduce_add_lanes: the same bits, with a third of the loads
// and no widened copy of the keys. head_dim must be a multiple of 16.
template <class V, bool F16, int SUB>
inline void score_heads8(const float* q, int hd, const uint8_t* const* k, int live, float scale, float* scores,
                         size_t score_stride) {
  using F = typename V::F;
  constexpr int W = V::kWidth;
  static_assert(W == 16, "16-lane vectors only");
  F acc[SUB][8];
  for (int j = 0; j < SUB; ++j) {
    for (int u = 0; u < 8; ++u) acc[j][u] = V::zero();
  }
  for (int d = 0; d < hd; d += W) {
    F qv[SUB];
    for (int j = 0; j < SUB; ++j) qv[j] = V::load(q + j * hd + d);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const F kv = load_kv<V, F16>(k[u], d);
      for (int j = 0; j < SUB; ++j) acc[j][u] = V::fmadd(qv[j], kv, acc[j][u]);
    }
  }
  for (int j = 0; j < SUB; ++j) {
    V::store_partial(scores + j * score_stride, V::mul(V::reduce_add_lanes8(acc[j]), V::set1(scale)), live);
  }
}

// Query vectors whose whole outputs (NC vectors each) one P V pass keeps in registers: about half the registers.
template <class V, int NC>
constexpr int value_block() {
  return (V::kWidth == 16 ? 16 : 8) / NC > 0 ? (V::kWidth == 16 ? 16 : 8) / NC : 1;
}

// out[i] = sum over positions t < context of p[i][t] * V[t] for JB query vectors at once, head_dim = NC vectors:
// every V row is read once for all of them. Only the first n are real: the others repeat the last one.
template <class V, bool F16, int NC, int JB>
inline void weighted_values_block(const uint8_t* v_cache, const size_t* offsets, const float* p, size_t p_stride,
                                  int context, int n, float* const* out) {
  using F = typename V::F;
  constexpr int W = V::kWidth;
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
inline void weighted_values(const uint8_t* v_cache, const size_t* offsets, const float* scores, size_t score_stride,
                            int context, int group, int hd, float* out) {
  constexpr int W = V::kWidth;
  auto blocks = [&](auto chunks) {
    constexpr int NC = decltype(chunks)::value;
    constexpr int JB = value_block<V, NC>();
    for (int j0 = 0; j0 < group; j0 += JB) {
      const int n = group - j0 < JB ? group - j0 : JB;
      float* outs[JB];
      for (int j = 0; j < n; ++j) outs[j] = out + (j0 + j) * hd;
      const float* p = scores + j0 * score_stride;
      // Exactly n vectors for the small remainders GQA groups leave (3 of 4, ...): no accumulators spent on
      // copies. Larger remainders repeat the last vector.
      auto exact = [&](auto rows) {
        constexpr int N = decltype(rows)::value;
        weighted_values_block<V, F16, NC, N>(v_cache, offsets, p, score_stride, context, N, outs);
      };
      if (n == 1) {
        exact(std::integral_constant<int, 1>());
      } else if (n == 2 && JB >= 2) {
        exact(std::integral_constant<int, (JB >= 2 ? 2 : 1)>());
      } else if (n == 3 && JB >= 3) {
        exact(std::integral_constant<int, (JB >= 3 ? 3 : 1)>());
      } else {
        weighted_values_block<V, F16, NC, JB>(v_cache, offsets, p, score_stride, context, n, outs);
      }
    }
  };
  switch (hd % W == 0 ? hd / W : 0) {
    case 1: return blocks(std::integral_constant<int, 1>());
    case 2: return blocks(std::integral_constant<int, 2>());
    case 4: return blocks(std::integral_constant<int, 4>());
    case 8: return blocks(std::integral_constant<int, 8>());
    default:
      for (int j = 0; j < group; ++j) {
        weighted_values_chunked<V, F16>(v_cache, offsets, scores + j * score_stride, context, hd, out + j * hd);
      }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Split-K over fixed chunks of positions (see AttentionArgs in kernels.h). Every row, prefill or decode, goes
// through the same arithmetic: its chunks' partials are computed alike wherever they run and folded in chunk order
// by the same function, so a row's bits depend neither on what else is in the batch nor on how its prompt was
// chunked, nor on the number of threads. (Treating a prefill chunk's rows as a small matrix, with keys transposed
// once per block, saved about a fifth of the score work but gave prefill rows different roundings than decode rows.)

// Byte offsets, in a layer's K or V region, of the rows (all KV heads) of positions [t_begin, t_end). Block by
// block: no integer division per position.
inline void chunk_offsets(const AttentionArgs& a, const int32_t* block_table, size_t row_bytes, int t_begin, int t_end,
                          size_t* offsets) {
  int blk = t_begin / a.block_size, i = t_begin % a.block_size;
  size_t base = static_cast<size_t>(block_table[blk]) * a.block_size * row_bytes;
  for (int t = t_begin; t < t_end; ++t) {
    offsets[t - t_begin] = base + static_cast<size_t>(i) * row_bytes;
    if (++i == a.block_size && t + 1 < t_end) {
      i = 0;
      base = static_cast<size_t>(block_table[++blk]) * a.block_size * row_bytes;
    }
  }
}

// One row's partial over the n positions of one chunk (offsets[0, n)), every query head: the unnormalised P V of
// each head, then each head's max score and sum of exponentials (layout of attention_partial_floats).
template <class V, bool F16>
inline void chunk_partial(const AttentionArgs& a, const float* q, const size_t* offsets, int n, float* scores,
                          size_t score_stride, float* partial) {
  constexpr int W = V::kWidth;
  const int group = a.num_heads / a.num_kv_heads;
  const int hd = a.head_dim;
  const size_t head_bytes = static_cast<size_t>(hd) * (F16 ? 2 : 4);
  // Scores W positions at a time for all KV heads, so K is read as whole rows in order; the same rows of V are
  // requested meanwhile for the P V pass below, which otherwise would wait for each of them. With the shared-key
  // scores (16 lanes) the requests are spread over the work, a few lines before each 8 positions of one head: the
  // head's V lines of those positions and its K lines of the same positions one group ahead (other paths: before
  // each head of a group, that head's lines of the group's V and the next group's K). Decode reads a
  // layer's K and V from DRAM (the weights streamed since evict them), and a burst of requests per group stalls
  // on the core's miss buffers while spread ones overlap the FMAs: one layer's avx512 decode attention at context
  // 700 from DRAM, 2 threads, measured 32-34 us against 63-68 with one burst of V requests per group (35-37
  // against 73-77 with the sequence's blocks scattered over the pool).
  const bool shared_scores = W == 16 && hd % W == 0;
  for (int t0 = 0; t0 < n; t0 += W) {
    const int live = n - t0 < W ? n - t0 : W;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const uint8_t* k[W];
      for (int u = 0; u < W; ++u) k[u] = a.k_cache + offsets[t0 + (u < live ? u : live - 1)] + h * head_bytes;
      const float* qh = q + static_cast<int64_t>(h) * group * hd;
      float* sh = scores + static_cast<size_t>(h) * group * score_stride + t0;
      if constexpr (W == 16) {
        if (shared_scores) {
          // The group's heads three at a time (then two or one), each set over 8 positions at a time.
          for (int half = 0; half < live; half += 8) {
            const int n8 = live - half < 8 ? live - half : 8;
            auto request = [&](const uint8_t* region, int t) {
              const char* p = reinterpret_cast<const char*>(region + offsets[t] + h * head_bytes);
              for (size_t off = 0; off < head_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
            };
            for (int t = t0 + half; t < t0 + half + n8; ++t) request(a.v_cache, t);
            for (int t = t0 + W + half; t < t0 + W + half + 8 && t < n; ++t) request(a.k_cache, t);
            for (int j0 = 0; j0 < group; j0 += 3) {
              const float* qj = qh + static_cast<int64_t>(j0) * hd;
              float* sj = sh + static_cast<size_t>(j0) * score_stride + half;
              switch (group - j0 < 3 ? group - j0 : 3) {
                case 1: score_heads8<V, F16, 1>(qj, hd, k + half, n8, a.scale, sj, score_stride); break;
                case 2: score_heads8<V, F16, 2>(qj, hd, k + half, n8, a.scale, sj, score_stride); break;
                default: score_heads8<V, F16, 3>(qj, hd, k + half, n8, a.scale, sj, score_stride); break;
              }
            }
          }
          continue;
        }
      }
      // As above, spread: this head's V lines of the group, and its K lines of the next group.
      for (int t = t0; t < t0 + 2 * W && t < n; ++t) {
        const uint8_t* region = t < t0 + W ? a.v_cache : a.k_cache;
        const char* p = reinterpret_cast<const char*>(region + offsets[t] + h * head_bytes);
        for (size_t off = 0; off < head_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
      }
      if (F16 && group > 1 && hd <= kAttentionConvertMaxDim) {
        // Halves widened once for the group's heads rather than once per head (exact, so the same bits).
        alignas(64) float widened[W * kAttentionConvertMaxDim];
        const uint8_t* kf[W];
        for (int u = 0; u < W; ++u) {
          float* dst = widened + u * hd;
          // Whole vectors with plain moves: AVX2's partial forms go through a buffer and a masked store, which
          // made this loop most of the avx2 f16 attention.
          int d = 0;
          for (; d + W <= hd; d += W) V::store(dst + d, load_kv<V, true>(k[u], d));
          if (d < hd) V::store_partial(dst + d, load_kv_partial<V, true>(k[u], d, hd - d), hd - d);
          kf[u] = reinterpret_cast<const uint8_t*>(dst);
        }
        score_positions<V, false>(qh, group, hd, kf, live, a.scale, sh, score_stride);
      } else {
        score_positions<V, F16>(qh, group, hd, k, live, a.scale, sh, score_stride);
      }
    }
  }
  float* max = partial + static_cast<size_t>(a.num_heads) * hd;
  float* sum = max + a.num_heads;
  for (int j = 0; j < a.num_heads; ++j) exp_scores<V>(scores + j * score_stride, n, max + j, sum + j);
  for (int h = 0; h < a.num_kv_heads; ++h) {
    weighted_values<V, F16>(a.v_cache + h * head_bytes, offsets, scores + static_cast<size_t>(h) * group * score_stride,
                            score_stride, n, group, hd, partial + static_cast<size_t>(h) * group * hd);
  }
}

// Folds one chunk's partial into a row's output and its state (max, sum per head): the first chunk is copied,
// a later one rescales both sides to the larger max. Explicit FMAs: the same bits wherever this is inlined.
template <class V>
inline void fold_partial(int num_heads, int hd, const float* partial, bool first, float* out, float* state) {
  constexpr int W = V::kWidth;
  const float* max = partial + static_cast<size_t>(num_heads) * hd;
  const float* sum = max + num_heads;
  for (int j = 0; j < num_heads; ++j) {
    const float* src = partial + static_cast<size_t>(j) * hd;
    float* dst = out + static_cast<size_t>(j) * hd;
    if (first) {
      state[2 * j] = max[j];
      state[2 * j + 1] = sum[j];
      std::memcpy(dst, src, sizeof(float) * hd);
      continue;
    }
    const float m = state[2 * j] > max[j] ? state[2 * j] : max[j];
    const float alpha = std::exp(state[2 * j] - m), beta = std::exp(max[j] - m);
    state[2 * j] = m;
    state[2 * j + 1] = std::fma(state[2 * j + 1], alpha, sum[j] * beta);
    const auto va = V::set1(alpha), vb = V::set1(beta);
    for (int d = 0; d < hd; d += W) {
      const int64_t live = hd - d < W ? hd - d : W;
      V::store_partial(dst + d, V::fmadd(V::load_partial(dst + d, live), va, V::mul(V::load_partial(src + d, live), vb)),
                       live);
    }
  }
}

template <class V>
inline void finish_row(int num_heads, int hd, const float* state, float* out) {
  constexpr int W = V::kWidth;
  for (int j = 0; j < num_heads; ++j) {
    const auto inv = V::set1(1.0f / state[2 * j + 1]);
    float* dst = out + static_cast<size_t>(j) * hd;
    for (int d = 0; d < hd; d += W) {
      const int64_t live = hd - d < W ? hd - d : W;
      V::store_partial(dst + d, V::mul(V::load_partial(dst + d, live), inv), live);
    }
  }
}

// KernelTable::attention_chunks. Chunk-major, so a prefill unit's rows reuse each chunk's K and V from L2.
template <class V, bool F16>
void chunk_unit(const AttentionArgs& a, int seq, int row_begin, int row_end, int chunk, float* partials,
                size_t partial_row_stride, float* scratch) {
  const int nh = a.num_heads, hd = a.head_dim;
  const int64_t q_stride = static_cast<int64_t>(nh) * hd;
  const int first_row = a.query_start_loc[seq];
  const int num_new = a.query_start_loc[seq + 1] - first_row;
  const int cached = a.seq_lens[seq] - num_new;
  const int max_context = cached + row_end;
  const int32_t* block_table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const size_t row_bytes = static_cast<size_t>(a.num_kv_heads) * hd * (F16 ? 2 : 4);
  const size_t partial_floats = attention_partial_floats(nh, hd);

  // Scratch: scores [nh][score_stride], the chunk's offsets, one partial, the fold state of each row.
  const size_t score_stride = attention_score_stride(kAttentionChunk);
  float* scores = scratch;
  size_t* offsets = reinterpret_cast<size_t*>(scratch + static_cast<size_t>(nh) * score_stride);
  float* partial = scratch + static_cast<size_t>(nh) * score_stride + 2 * kAttentionChunk;
  float* state = partial + partial_floats;

  // With a sliding window a row starts at its window's first position: chunks before it are skipped, and the chunk
  // holding it is read from there (the rows of a unit are in position order, so the first row's chunk comes first).
  const int c_first = attention_first_position(a, cached + row_begin + 1) / kAttentionChunk;
  const int c_begin = partials ? chunk : c_first, c_end = partials ? chunk + 1 : attention_chunks(max_context);
  for (int c = c_begin; c < c_end; ++c) {
    const int t_begin = c * kAttentionChunk;
    const int t_end = max_context - t_begin < kAttentionChunk ? max_context : t_begin + kAttentionChunk;
    chunk_offsets(a, block_table, row_bytes, t_begin, t_end, offsets);
    for (int r = row_begin; r < row_end; ++r) {
      const int context = cached + r + 1;
      if (context <= t_begin) continue;
      const int t0 = attention_first_position(a, context);
      if (t0 >= t_begin + kAttentionChunk) continue;
      const int skip = t0 > t_begin ? t0 - t_begin : 0;
      const int n = (context - t_begin < kAttentionChunk ? context - t_begin : kAttentionChunk) - skip;
      const int64_t token = first_row + r;
      float* dst = partials ? partials + (r - row_begin) * partial_row_stride + c * partial_floats : partial;
      chunk_partial<V, F16>(a, a.q + token * q_stride, offsets + skip, n, scores, score_stride, dst);
      if (!partials) {
        fold_partial<V>(nh, hd, dst, c == t0 / kAttentionChunk, a.out + token * q_stride, state + (r - row_begin) * 2 * nh);
      }
    }
  }
  if (partials) return;
  for (int r = row_begin; r < row_end; ++r) {
    finish_row<V>(nh, hd, state + (r - row_begin) * 2 * nh, a.out + (first_row + r) * q_stride);
  }
}

template <class V>
void simd_attention_chunks(const AttentionArgs& a, int seq, int row_begin, int row_end, int chunk, float* partials,
                           size_t partial_row_stride, float* scratch) {
  if (a.kv_f16) {
    chunk_unit<V, true>(a, seq, row_begin, row_end, chunk, partials, partial_row_stride, scratch);
  } else {
    chunk_unit<V, false>(a, seq, row_begin, row_end, chunk, partials, partial_row_stride, scratch);
  }
}

// KernelTable::attention_merge.
template <class V>
void simd_attention_merge(const AttentionArgs& a, int seq, int row, const float* partials, float* scratch) {
  const int nh = a.num_heads, hd = a.head_dim;
  const int first_row = a.query_start_loc[seq];
  const int num_new = a.query_start_loc[seq + 1] - first_row;
  const int context = a.seq_lens[seq] - num_new + row + 1;
  const size_t partial_floats = attention_partial_floats(nh, hd);
  float* out = a.out + (first_row + row) * static_cast<int64_t>(nh) * hd;
  const int c_first = attention_first_position(a, context) / kAttentionChunk;
  for (int c = c_first; c < attention_chunks(context); ++c) {
    fold_partial<V>(nh, hd, partials + c * partial_floats, c == c_first, out, scratch);
  }
  finish_row<V>(nh, hd, scratch, out);
}
