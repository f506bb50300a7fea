// Plain C++ paged attention: for each new row and query head, scores against every visible position read through
// the block table, a softmax, and the weighted sum of V. Two passes over the context per (row, head).
#include <cmath>

#include "kernels.h"

namespace conduit {

namespace {

inline float load_element(const uint8_t* base, int64_t index, bool f16) {
  if (f16) {
    uint16_t h;
    std::memcpy(&h, base + 2 * index, 2);
    return fp16_to_fp32(h);
  }
  float f;
  std::memcpy(&f, base + 4 * index, 4);
  return f;
}

void attention(const AttentionArgs& a, int seq, int kv_head, int row_begin, int row_end, float* scratch) {
  const int group = a.num_heads / a.num_kv_heads;
  const int64_t q_stride = static_cast<int64_t>(a.num_heads) * a.head_dim;
  const int first_row = a.query_start_loc[seq];
  const int num_new = a.query_start_loc[seq + 1] - first_row;
  const int seq_len = a.seq_lens[seq];
  const int32_t* block_table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  // Element index of (position t, this KV head, d = 0) in a layer's K or V region.
  auto element_index = [&](int t) {
    const int64_t slot = static_cast<int64_t>(block_table[t / a.block_size]) * a.block_size + t % a.block_size;
    return (slot * a.num_kv_heads + kv_head) * a.head_dim;
  };

  float* scores = scratch;
  for (int r = row_begin; r < row_end; ++r) {
    const int context = seq_len - num_new + r + 1;  // positions 0 .. this row's own position
    const int t0 = attention_first_position(a, context);  // the window's first position (0 without one)
    const int64_t token = first_row + r;
    for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      const float* q = a.q + token * q_stride + static_cast<int64_t>(h) * a.head_dim;
      for (int t = t0; t < context; ++t) {
        const int64_t base = element_index(t);
        float dot = 0.0f;
        for (int d = 0; d < a.head_dim; ++d) dot += q[d] * load_element(a.k_cache, base + d, a.kv_f16);
        scores[t - t0] = dot * a.scale;
      }
      const int n = context - t0;
      float max = -INFINITY;
      for (int t = 0; t < n; ++t) max = scores[t] > max ? scores[t] : max;
      float sum = 0.0f;
      for (int t = 0; t < n; ++t) {
        scores[t] = std::exp(scores[t] - max);
        sum += scores[t];
      }
      const float inv_sum = 1.0f / sum;
      float* out = a.out + token * q_stride + static_cast<int64_t>(h) * a.head_dim;
      for (int d = 0; d < a.head_dim; ++d) out[d] = 0.0f;
      for (int t = t0; t < context; ++t) {
        const int64_t base = element_index(t);
        const float p = scores[t - t0] * inv_sum;
        for (int d = 0; d < a.head_dim; ++d) out[d] += p * load_element(a.v_cache, base + d, a.kv_f16);
      }
    }
  }
}

}  // namespace

void register_attention_generic(KernelTable& t) {
  t.attention = attention;
  t.names["attention"] = "generic";
}

}  // namespace conduit
