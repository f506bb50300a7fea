#include "model.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "memory.h"
#include "moe.h"

namespace conduit {

void Model::FreeMoe::operator()(MoeBlock* p) const { delete p; }

namespace {

std::string describe(const char* name, const TensorRef& t) {
  return std::string(name) + " (" + type_name(t.type) + " [" + std::to_string(t.cols) + ", " +
         std::to_string(t.rows) + "])";
}

void check_matrix(const char* name, const TensorRef& t, int64_t cols, int64_t rows) {
  if (!t.data) throw InvalidInput(std::string("missing tensor ") + name);
  if (!is_supported_type(t.type)) {
    throw InvalidInput(std::string(name) + " has unsupported ggml type " + std::to_string(t.type));
  }
  if (t.cols != cols || t.rows != rows) {
    throw InvalidInput(describe(name, t) + ": expected shape [" + std::to_string(cols) + ", " +
                       std::to_string(rows) + "]");
  }
  if (cols % type_block_elements(t.type) != 0) {
    throw InvalidInput(describe(name, t) + ": row length is not a multiple of the block size " +
                       std::to_string(type_block_elements(t.type)));
  }
}

// Norm weights and biases are tiny: keep an f32 copy whatever type the file used.
std::vector<float> to_f32(const char* name, const TensorRef& t, int64_t n) {
  check_matrix(name, t, n, 1);
  std::vector<float> out(n);
  dequantize_row_generic(t.type, t.data, out.data(), n);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Load

Model::Model(ModelSpec spec, Variant variant, int threads)
    : spec_(std::move(spec)), variant_(variant), kt_(kernel_table(variant)), pool_(threads) {
  const ModelSpec& s = spec_;
  if (s.vocab_size <= 0 || s.dim <= 0 || s.num_heads <= 0 || s.num_kv_heads <= 0 || s.head_dim <= 0 ||
      s.ffn_dim <= 0 || s.layers.empty()) {
    throw InvalidInput("model dimensions must be positive and the model must have at least one layer");
  }
  if (s.num_heads % s.num_kv_heads != 0) {
    throw InvalidInput("numHeads " + std::to_string(s.num_heads) + " is not a multiple of numKvHeads " +
                       std::to_string(s.num_kv_heads));
  }
  if (s.rope.scaling == RopeConfig::Scaling::LongRope &&
      s.rope.freq_factors.size() != static_cast<size_t>(s.rope.rope_dim / 2)) {
    throw InvalidInput("LongRoPE needs ropeDim / 2 = " + std::to_string(s.rope.rope_dim / 2) + " factors, got " +
                       std::to_string(s.rope.freq_factors.size()));
  }
  if (s.rope.rope_dim <= 0 || s.rope.rope_dim % 2 != 0 || s.rope.rope_dim > s.head_dim) {
    throw InvalidInput("ropeDim " + std::to_string(s.rope.rope_dim) + " must be even and at most headDim " +
                       std::to_string(s.head_dim));
  }
  if (s.num_blocks <= 0 || s.block_size <= 0) throw InvalidInput("numBlocks and blockSize must be positive");
  if (!s.layer_window.empty() && s.layer_window.size() != s.layers.size()) {
    throw InvalidInput("layerWindows has " + std::to_string(s.layer_window.size()) + " entries for " +
                       std::to_string(s.layers.size()) + " layers");
  }
  for (int w : s.layer_window) {
    if (w < 0) throw InvalidInput("a sliding window must be >= 0, got " + std::to_string(w));
  }
  if (s.has_local_rope && s.rope_local.rope_dim != s.rope.rope_dim) {
    throw InvalidInput("the local RoPE must rotate as many dimensions as the global one");
  }
  if (s.n_expert < 0 || (s.n_expert > 0 && (s.n_expert_used <= 0 || s.n_expert_used > s.n_expert ||
                                            s.expert_ffn_dim <= 0))) {
    throw InvalidInput("experts: need 0 < nExpertsUsed <= nExperts and a positive expertFfnDim");
  }
  if (s.n_expert > 0) moe_.reset(new MoeBlock());
  const int64_t q_dim = s.num_heads * s.head_dim, kv_dim = s.num_kv_heads * s.head_dim;
  int64_t num_slots = 0, pool_elements = 0, pool_bytes_signed = 0;
  if (!mul_fits(s.num_blocks, s.block_size, &num_slots) || !mul_fits(num_slots, kv_dim, &pool_elements) ||
      !mul_fits(pool_elements, 2 * static_cast<int64_t>(s.layers.size()) * (s.kv_f16 ? 2 : 4), &pool_bytes_signed)) {
    throw InvalidInput("the KV pool's layout (numBlocks x blockSize x KV width) is too large");
  }
  const size_t pool_bytes = static_cast<size_t>(pool_bytes_signed);
  if (!s.kv_pool || s.kv_pool_bytes != pool_bytes) {
    throw InvalidInput("KV pool is " + std::to_string(s.kv_pool_bytes) + " bytes, the layout needs " +
                       std::to_string(pool_bytes));
  }

  check_matrix("token_embd", s.token_embedding, s.dim, s.vocab_size);
  check_matrix("output", s.output, s.dim, s.vocab_size);
  output_norm_ = to_f32("output_norm", s.output_norm, s.dim);
  for (size_t l = 0; l < s.layers.size(); ++l) {
    const LayerRefs& L = s.layers[l];
    const std::string p = "blk." + std::to_string(l) + ".";
    check_matrix((p + "attn_q").c_str(), L.wq, s.dim, q_dim);
    check_matrix((p + "attn_k").c_str(), L.wk, s.dim, kv_dim);
    check_matrix((p + "attn_v").c_str(), L.wv, s.dim, kv_dim);
    check_matrix((p + "attn_output").c_str(), L.wo, q_dim, s.dim);
    if (s.n_expert == 0) {
      check_matrix((p + "ffn_gate").c_str(), L.w_gate, s.dim, s.ffn_dim);
      check_matrix((p + "ffn_up").c_str(), L.w_up, s.dim, s.ffn_dim);
      check_matrix((p + "ffn_down").c_str(), L.w_down, s.ffn_dim, s.dim);
    } else {
      const int64_t E = s.n_expert, F = s.expert_ffn_dim;
      check_matrix((p + "ffn_gate_inp").c_str(), L.gate_inp, s.dim, E);
      check_matrix((p + "ffn_gate_exps").c_str(), L.w_gate, s.dim, F * E);
      check_matrix((p + "ffn_up_exps").c_str(), L.w_up, s.dim, F * E);
      check_matrix((p + "ffn_down_exps").c_str(), L.w_down, F, s.dim * E);
      LayerRefs& M = spec_.layers[l];
      M.gate_exps.clear();
      M.up_exps.clear();
      M.down_exps.clear();
      for (int64_t e = 0; e < E; ++e) {
        auto slice = [&](const TensorRef& t, int64_t rows) {
          TensorRef r = t;
          r.rows = rows;
          r.data = t.data + row_bytes(t.type, t.cols) * static_cast<size_t>(e * rows);
          return r;
        };
        M.gate_exps.push_back(slice(L.w_gate, F));
        M.up_exps.push_back(slice(L.w_up, F));
        M.down_exps.push_back(slice(L.w_down, s.dim));
      }
    }
    if (s.qk_norm) {
      q_norm_.push_back(to_f32((p + "attn_q_norm").c_str(), L.q_norm, s.head_dim));
      k_norm_.push_back(to_f32((p + "attn_k_norm").c_str(), L.k_norm, s.head_dim));
    }
    attn_norm_.push_back(to_f32((p + "attn_norm").c_str(), L.attn_norm, s.dim));
    ffn_norm_.push_back(to_f32((p + "ffn_norm").c_str(), L.ffn_norm, s.dim));
    if (s.post_norms) {
      attn_post_norm_.push_back(to_f32((p + "post_attention_norm").c_str(), L.attn_post_norm, s.dim));
      ffn_post_norm_.push_back(to_f32((p + "post_ffw_norm").c_str(), L.ffn_post_norm, s.dim));
    }
    if (s.qkv_bias) {
      bq_.push_back(to_f32((p + "attn_q.bias").c_str(), L.bq, q_dim));
      bk_.push_back(to_f32((p + "attn_k.bias").c_str(), L.bk, kv_dim));
      bv_.push_back(to_f32((p + "attn_v.bias").c_str(), L.bv, kv_dim));
    }
  }
  inv_freq_ = rope_inverse_frequencies(s.rope);
  if (s.has_local_rope) inv_freq_local_ = rope_inverse_frequencies(s.rope_local);
  if (s.pack_weights) pack_weights();
  if (s.release_unpacked) {
    // Only the ggml bytes of packed matrices whose pages no embedding row lives on: the embedding lookup reads them.
    const uint8_t* embd_begin = s.token_embedding.data;
    const uint8_t* embd_end = embd_begin + row_bytes(s.token_embedding.type, s.token_embedding.cols) *
                                               static_cast<size_t>(s.token_embedding.rows);
    auto release = [&](const TensorRef& t) {
      if (!t.packed) return;
      const uint8_t* begin = t.data;
      const uint8_t* end = begin + row_bytes(t.type, t.cols) * static_cast<size_t>(t.rows);
      if (begin < embd_end && embd_begin < end) return;
      released_bytes_ += release_pages(begin, static_cast<size_t>(end - begin));
    };
    release(s.output);
    for (const LayerRefs& L : s.layers) {
      for (const TensorRef* t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) release(*t);
      for (const auto* experts : {&L.gate_exps, &L.up_exps, &L.down_exps}) {
        for (const TensorRef& t : *experts) release(t);
      }
    }
  }

  // Every matrix is streamed once per decode step: put the weights on huge pages (packed matrices are streamed
  // from their copy, already on huge pages, unless the embedding table shares their bytes). Tensors of one file
  // lie next to each other (most are smaller than a huge page), so contiguous runs are advised as a whole.
  std::vector<std::pair<const uint8_t*, const uint8_t*>> ranges;
  auto add = [&](const TensorRef& t) {
    if (t.packed && t.data != s.token_embedding.data) return;
    ranges.emplace_back(t.data, t.data + row_bytes(t.type, t.cols) * static_cast<size_t>(t.rows));
  };
  for (const TensorRef* t : {&s.token_embedding, &s.output, &s.output_norm}) add(*t);
  for (const LayerRefs& L : s.layers) {
    for (const TensorRef* t : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_norm, &L.w_gate, &L.w_up, &L.w_down}) {
      add(*t);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  constexpr ptrdiff_t kMaxGap = 4096;  // alignment padding between tensors of one file, never an unmapped hole
  for (size_t i = 0; i < ranges.size();) {
    const uint8_t* begin = ranges[i].first;
    const uint8_t* end = ranges[i].second;
    for (++i; i < ranges.size() && ranges[i].first - end <= kMaxGap; ++i) end = std::max(end, ranges[i].second);
    huge_page_bytes_ += advise_huge_pages(begin, static_cast<size_t>(end - begin), true);
  }
  advise_huge_pages(s.kv_pool, s.kv_pool_bytes, false);
}

// Repacks every matrix whose kernel has a load-time layout into one allocation on huge pages, split over the
// pool by groups of panels. The ggml bytes stay untouched: JavaScript owns them and other code reads them, and the
// token embedding (row gathers) keeps reading them even when the output projection shares them.
void Model::pack_weights() {
  std::vector<TensorRef*> matrices{&spec_.output};
  for (LayerRefs& L : spec_.layers) {
    for (TensorRef* t : {&L.wq, &L.wk, &L.wv, &L.wo}) matrices.push_back(t);
    if (spec_.n_expert == 0) {
      for (TensorRef* t : {&L.w_gate, &L.w_up, &L.w_down}) matrices.push_back(t);
    }
    // Experts are packed one by one (each is a matmul of its own).
    for (auto* experts : {&L.gate_exps, &L.up_exps, &L.down_exps}) {
      for (TensorRef& t : *experts) matrices.push_back(&t);
    }
  }
  constexpr size_t kMatrixAlign = 4096;
  std::vector<std::pair<TensorRef*, size_t>> packed;  // matrix, offset in the allocation
  size_t total = 0;
  for (TensorRef* t : matrices) {
    const MatmulKernel& mk = kt_.matmul[t->type];
    if (!mk.pack) continue;
    packed.emplace_back(t, total);
    total += (mk.packed_bytes(t->rows, t->cols) + kMatrixAlign - 1) & ~(kMatrixAlign - 1);
  }
  if (packed.empty()) return;
  constexpr size_t kHugePage = 2u << 20;
  const size_t bytes = (total + kHugePage - 1) & ~(kHugePage - 1);
  packed_.reset(static_cast<uint8_t*>(std::aligned_alloc(kHugePage, bytes)));
  if (!packed_) throw std::bad_alloc();
  packed_bytes_ = bytes;
  // Advised before the first touch, so the pages are huge as they are faulted in by the packing below.
  huge_page_bytes_ += advise_huge_pages(packed_.get(), bytes, false);

  struct Item {
    const TensorRef* t;
    uint8_t* out;
    int64_t panel_begin, panel_end;
  };
  constexpr int64_t kPanelsPerItem = 16;
  std::vector<Item> items;
  for (auto& [t, offset] : packed) {
    uint8_t* out = packed_.get() + offset;
    const int64_t panels = packed_panel_count(t->rows);
    for (int64_t p = 0; p < panels; p += kPanelsPerItem) {
      items.push_back({t, out, p, min64(panels, p + kPanelsPerItem)});
    }
    t->packed = out;
  }
  pool_.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i, int) {
    const Item& it = items[i];
    kt_.matmul[it.t->type].pack(it.t->data, it.t->rows, it.t->cols, it.panel_begin, it.panel_end, it.out);
  });
}

MatmulOutput Model::output_of(const TensorRef& t, float* y, int64_t ldy) const {
  if (t.packed) return {t.packed, t.type, t.rows, y, ldy, true};
  return {t.data, t.type, t.rows, y, ldy, false};
}

void Model::set_profiling(bool on) {
  profile_.enabled = on;
  pool_.timing().enabled = on;
  ws_.profile = on ? &profile_ : nullptr;
}

Profile Model::take_profile() {
  Profile out = profile_;
  ThreadPool::Timing& timing = pool_.timing();
  if (timing.jobs > 0) {
    out.sections["pool hand-over wait"] = {timing.wait_seconds, timing.jobs};
  }
  timing.jobs = 0;
  timing.wait_seconds = 0;
  profile_.sections.clear();
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// LoRA adapters

const LoraPlan* Model::fused_lora(const int32_t* slots, int64_t rows, int64_t layer, const LoraOutput* outputs,
                                  int count) {
  if (!lora_fuse_ || !slots) return nullptr;
  if (!lora_plan_.plan(loras_, slots, rows, layer, outputs, count)) return nullptr;
  // The adapted matmul that follows this one in the forward pass, whose A matrices this one's tiles prefetch: the
  // cycle K, V, Q -> O -> gate, up -> down -> the next layer's K, V, Q, skipping stages these adapters do not adapt
  // (q and v only, attention only on a mixture of experts).
  struct Stage {
    LoraTarget targets[3];
    int count;
  };
  static constexpr Stage kStages[4] = {
      {{kLoraK, kLoraV, kLoraQ}, 3}, {{kLoraO}, 1}, {{kLoraGate, kLoraUp}, 2}, {{kLoraDown}, 1}};
  const LoraTarget t = outputs[0].target;
  const int stage = t == kLoraO ? 1 : t == kLoraGate || t == kLoraUp ? 2 : t == kLoraDown ? 3 : 0;
  for (int step = 1; step <= 4; ++step) {
    const Stage& next = kStages[(stage + step) % 4];
    lora_plan_.set_next(layer + (stage + step) / 4, next.targets, next.count);
    if (lora_plan_.has_next()) break;
  }
  return &lora_plan_;
}

void Model::set_lora(int slot, std::unique_ptr<LoraAdapter> adapter) {
  if (slot < 0 || slot > 4096) throw InvalidInput("LoRA slot " + std::to_string(slot) + " is outside [0, 4096]");
  if (adapter) {
    const ModelSpec& s = spec_;
    const int64_t q_dim = s.num_heads * s.head_dim, kv_dim = s.num_kv_heads * s.head_dim;
    const int64_t in_of[kLoraTargetCount] = {s.dim, s.dim, s.dim, q_dim, s.dim, s.dim, s.ffn_dim};
    const int64_t out_of[kLoraTargetCount] = {q_dim, kv_dim, kv_dim, s.dim, s.ffn_dim, s.ffn_dim, s.dim};
    if (adapter->layers.size() > s.layers.size()) {
      throw InvalidInput("LoRA adapter has " + std::to_string(adapter->layers.size()) + " layers, the model " +
                         std::to_string(s.layers.size()));
    }
    for (size_t l = 0; l < adapter->layers.size(); ++l) {
      for (int t = 0; t < kLoraTargetCount; ++t) {
        const LoraMatrix& m = adapter->layers[l][t];
        if (m.rank == 0) continue;
        int64_t a_size = 0, b_size = 0;
        if (m.rank < 0 || m.in != in_of[t] || m.out != out_of[t] || !mul_fits(m.rank, m.in, &a_size) ||
            !mul_fits(m.out, m.rank, &b_size) || m.a.size() != static_cast<size_t>(a_size) ||
            m.b.size() != static_cast<size_t>(b_size)) {
          throw InvalidInput("LoRA adapter layer " + std::to_string(l) + " target " + std::to_string(t) +
                             " does not fit the model: rank " + std::to_string(m.rank) + ", in " +
                             std::to_string(m.in) + " (model " + std::to_string(in_of[t]) + "), out " +
                             std::to_string(m.out) + " (model " + std::to_string(out_of[t]) + ")");
        }
      }
    }
  }
  loras_.set(slot, std::move(adapter));
}

// ---------------------------------------------------------------------------------------------------------------
// Batch checks: a bad index here would read or write outside the pool, so every one is checked.

void Model::validate(const StepBatch& b) const {
  const ModelSpec& s = spec_;
  const int64_t num_slots = s.num_blocks * s.block_size;
  if (b.num_seqs < 0 || b.max_blocks_per_seq < 0) throw InvalidInput("numSeqs and maxBlocksPerSeq must be >= 0");
  for (int64_t i = 0; i < b.num_tokens; ++i) {
    if (b.token_ids[i] < 0 || b.token_ids[i] >= s.vocab_size) {
      throw InvalidInput("tokenIds[" + std::to_string(i) + "] = " + std::to_string(b.token_ids[i]) +
                         " is outside the vocabulary [0, " + std::to_string(s.vocab_size) + ")");
    }
    if (b.slot_mapping[i] < 0 || b.slot_mapping[i] >= num_slots) {
      throw InvalidInput("slotMapping[" + std::to_string(i) + "] = " + std::to_string(b.slot_mapping[i]) +
                         " is outside the pool's " + std::to_string(num_slots) + " slots");
    }
  }
  if (b.query_start_loc[0] != 0 || b.query_start_loc[b.num_seqs] != b.num_tokens) {
    throw InvalidInput("queryStartLoc must start at 0 and end at numTokens");
  }
  for (int seq = 0; seq < b.num_seqs; ++seq) {
    const int32_t first = b.query_start_loc[seq], end = b.query_start_loc[seq + 1];
    const int64_t seq_len = b.seq_lens[seq];
    if (end < first) throw InvalidInput("queryStartLoc decreases at sequence " + std::to_string(seq));
    // Before its rows are read: a later decrease would be found only after reading past numTokens.
    if (end > b.num_tokens) throw InvalidInput("queryStartLoc passes numTokens at sequence " + std::to_string(seq));
    if (seq_len < end - first) {
      throw InvalidInput("seqLens[" + std::to_string(seq) + "] = " + std::to_string(seq_len) +
                         " is less than its " + std::to_string(end - first) + " new tokens");
    }
    if (seq_len > static_cast<int64_t>(b.max_blocks_per_seq) * s.block_size) {
      throw InvalidInput("seqLens[" + std::to_string(seq) + "] = " + std::to_string(seq_len) +
                         " does not fit in maxBlocksPerSeq * blockSize");
    }
    for (int64_t blk = 0; blk < div_ceil(seq_len, s.block_size); ++blk) {
      const int32_t id = b.block_tables[seq * static_cast<int64_t>(b.max_blocks_per_seq) + blk];
      if (id < 0 || id >= s.num_blocks) {
        throw InvalidInput("blockTables: sequence " + std::to_string(seq) + " block " + std::to_string(blk) +
                           " = " + std::to_string(id) + " is outside [0, " + std::to_string(s.num_blocks) + ")");
      }
    }
    for (int32_t r = first; r < end; ++r) {
      const int64_t expected = seq_len - (end - r);
      if (b.positions[r] != expected) {
        throw InvalidInput("positions[" + std::to_string(r) + "] = " + std::to_string(b.positions[r]) +
                           " but sequence " + std::to_string(seq) + " puts that row at position " +
                           std::to_string(expected));
      }
      const int64_t slot = b.slot_mapping[r];
      const int64_t expected_block = b.block_tables[seq * static_cast<int64_t>(b.max_blocks_per_seq) +
                                                    expected / s.block_size];
      if (slot != expected_block * s.block_size + expected % s.block_size) {
        throw InvalidInput("slotMapping[" + std::to_string(r) + "] = " + std::to_string(slot) +
                           " is not the slot of position " + std::to_string(expected) +
                           " in sequence " + std::to_string(seq) + "'s block table");
      }
    }
  }
  if (b.lora_slots) {
    for (int64_t i = 0; i < b.num_tokens; ++i) {
      const int32_t slot = b.lora_slots[i];
      if (slot != -1 && !loras_.get(slot)) {
        throw InvalidInput("loraSlots[" + std::to_string(i) + "] = " + std::to_string(slot) +
                           " names no loaded LoRA adapter");
      }
    }
  }
  for (int64_t i = 0; i < b.num_logits; ++i) {
    if (b.logits_indices[i] < 0 || b.logits_indices[i] >= b.num_tokens) {
      throw InvalidInput("logitsIndices[" + std::to_string(i) + "] = " + std::to_string(b.logits_indices[i]) +
                         " is not a row of the batch");
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Forward

// capacity_tokens_ moves only once every buffer has grown: an allocation that fails part-way (std::bad_alloc, which
// the binding reports as an error) leaves the model usable for steps no larger than before.
void Model::ensure_buffers(int64_t tokens) {
  if (tokens <= capacity_tokens_) return;
  const ModelSpec& s = spec_;
  const int64_t q_dim = s.num_heads * s.head_dim, kv_dim = s.num_kv_heads * s.head_dim;
  if (s.scratch_limit_bytes > 0) {
    const int64_t per_token = 3 * s.dim + 2 * q_dim + 2 * kv_dim + (s.n_expert == 0 ? 2 * s.ffn_dim : 0);
    const size_t wanted = static_cast<size_t>(tokens * per_token) * sizeof(float);
    if (wanted + workspace_bytes() > s.scratch_limit_bytes) throw std::bad_alloc();
  }
  x_.resize(tokens * s.dim);
  xn_.resize(tokens * s.dim);
  tmp_.resize(tokens * s.dim);
  q_.resize(tokens * q_dim);
  attn_.resize(tokens * q_dim);
  k_.resize(tokens * kv_dim);
  v_.resize(tokens * kv_dim);
  if (s.n_expert == 0) {
    gate_.resize(tokens * s.ffn_dim);
    up_.resize(tokens * s.ffn_dim);
  }
  capacity_tokens_ = tokens;
}

size_t Model::activation_bytes() const {
  size_t floats = 0;
  for (const std::vector<float>* v : {&x_, &xn_, &tmp_, &q_, &attn_, &k_, &v_, &gate_, &up_}) floats += v->capacity();
  return floats * sizeof(float);
}

size_t Model::workspace_bytes() const {
  size_t bytes = ws_.activations.capacity() + ws_.per_thread.capacity() + rope_.allocated_bytes() +
                 sel_rope_.allocated_bytes() + (sel_x_.capacity() + sel_xn_.capacity()) * sizeof(float) +
                 prompt_weights_.capacity() * sizeof(double);
  for (const sample::DrawScratch& scratch : draw_scratch_) bytes += scratch.bytes();
  for (const std::vector<int32_t>* v : {&sel_positions_, &sel_query_start_, &sel_seq_lens_, &sel_block_tables_,
                                        &sel_lora_slots_}) {
    bytes += v->capacity() * sizeof(int32_t);
  }
  if (moe_) bytes += moe_->scratch_bytes();
  bytes += lora_plan_.allocated_bytes();
  return bytes;
}

// The k best of n values into best[0, min(k, n)), best first, the lower id first among equal values: ids in order,
// each moved up past the kept ones it beats (a value greater than theirs); once k are kept nearly every id fails its
// one comparison against the worst kept value. The sampler's bestIds, id for id.
static void best_ids(const float* values, int64_t n, int64_t k, int32_t* best) {
  int64_t kept = 0;
  for (int64_t id = 0; id < n; ++id) {
    const float value = values[id];
    if (kept == k && !(value > values[best[k - 1]])) continue;
    int64_t at = kept < k ? kept++ : k - 1;
    while (at > 0 && value > values[best[at - 1]]) {
      best[at] = best[at - 1];
      --at;
    }
    best[at] = static_cast<int32_t>(id);
  }
}

void Model::prompt_logprob_rows(const float* logits, int64_t rows, const int32_t* targets, double* out, int32_t* best,
                                int64_t num_best, const int32_t* row_ids) {
  const int64_t vocab = spec_.vocab_size;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0 || targets[r] >= vocab) {
      throw InvalidInput("targets[" + std::to_string(r) + "] = " + std::to_string(targets[r]) + " is outside the vocabulary of " +
                         std::to_string(vocab));
    }
  }
  prompt_weights_.resize(static_cast<size_t>(pool_.size()) * static_cast<size_t>(vocab));
  pool_.parallel_for(rows, [&](int64_t r, int thread) {
    const float* row = logits + (row_ids != nullptr ? row_ids[r] : r) * vocab;
    double* result = out + 3 * r;
    const int64_t max_id = kt_.argmax(row, vocab);
    result[0] = static_cast<double>(max_id);
    result[1] = result[2] = 0;
    if (max_id < 0) return;
    int64_t last = 0;
    result[1] = kt_.sample_weigh(row, vocab, 1.0, row[max_id], -INFINITY, prompt_weights_.data() + thread * vocab, nullptr,
                                 nullptr, nullptr, &last);
    const float value = row[targets[r]];
    int64_t above = 0;
    for (int64_t i = 0; i < vocab; ++i) above += row[i] > value ? 1 : 0;
    result[2] = static_cast<double>(above);
    // The one best is the argmax (the same rule: the lowest id among the largest).
    if (num_best == 1) best[r] = static_cast<int32_t>(max_id);
    else if (num_best > 1) best_ids(row, vocab, num_best, best + r * num_best);
  });
}

void Model::sample_rows(const float* logits, int64_t count, const int32_t* rows, const double* specs, int32_t* out) {
  const int64_t vocab = spec_.vocab_size;
  draw_scratch_.resize(static_cast<size_t>(pool_.size()));
  for (sample::DrawScratch& scratch : draw_scratch_) scratch.reserve(vocab);
  pool_.parallel_for(count, [&](int64_t i, int thread) {
    out[i] = static_cast<int32_t>(sample::draw_row(kt_, logits + rows[i] * vocab, vocab, specs + i * sample::kDrawSpecWords,
                                                   draw_scratch_[static_cast<size_t>(thread)]));
  });
}

void Model::rmsnorm_heads(float* x, const std::vector<float>& weight, int64_t rows, int64_t heads) {
  const int64_t hd = spec_.head_dim, vectors = rows * heads;
  const float eps = spec_.rms_norm_eps;
  pool_.parallel_for(div_ceil(vectors, 64), [&](int64_t item, int) {
    for (int64_t v = item * 64; v < min64(vectors, item * 64 + 64); ++v) {
      kt_.rmsnorm(x + v * hd, weight.data(), x + v * hd, hd, eps);
    }
  });
}

void Model::rmsnorm_rows(const float* x, const float* weight, float* out, int64_t rows) {
  const int64_t dim = spec_.dim;
  const float eps = spec_.rms_norm_eps;
  pool_.parallel_for(div_ceil(rows, 16), [&](int64_t item, int) {
    for (int64_t r = item * 16; r < min64(rows, item * 16 + 16); ++r) {
      kt_.rmsnorm(x + r * dim, weight, out + r * dim, dim, eps);
    }
  });
}

void Model::add_rows(float* acc, const float* x, int64_t rows, int64_t width) {
  pool_.parallel_for(div_ceil(rows, 16), [&](int64_t item, int) {
    const int64_t r0 = item * 16, r1 = min64(rows, r0 + 16);
    kt_.add(acc + r0 * width, x + r0 * width, (r1 - r0) * width);
  });
}

void Model::add_bias(float* y, const std::vector<float>& bias, int64_t rows) {
  const int64_t width = static_cast<int64_t>(bias.size());
  for (int64_t r = 0; r < rows; ++r) kt_.add(y + r * width, bias.data(), width);
}

void Model::forward(const StepBatch& b, float* logits) {
  validate(b);
  if (b.num_tokens == 0) return;
  const ModelSpec& s = spec_;
  const int64_t T = b.num_tokens, dim = s.dim;
  const int64_t q_dim = s.num_heads * s.head_dim, kv_dim = s.num_kv_heads * s.head_dim;
  const int64_t num_layers = static_cast<int64_t>(s.layers.size());
  const size_t region_bytes = static_cast<size_t>(s.num_blocks * s.block_size * kv_dim) * (s.kv_f16 ? 2 : 4);
  ensure_buffers(std::max(T, b.num_logits));
  float *x = x_.data(), *xn = xn_.data(), *q = q_.data(), *k = k_.data(), *v = v_.data();
  float *attn = attn_.data(), *gate = gate_.data(), *up = up_.data(), *tmp = tmp_.data();

  Profile* prof = ws_.profile;
  // Embeddings: dequantize each token's row.
  const size_t embd_row_bytes = row_bytes(s.token_embedding.type, dim);
  std::optional<ProfileScope> scope(std::in_place, prof, "embedding");
  pool_.parallel_for(T, [&](int64_t r, int) {
    kt_.dequantize_row[s.token_embedding.type](s.token_embedding.data + b.token_ids[r] * embd_row_bytes,
                                               x + r * dim, dim);
    if (s.embedding_scale != 0.0f) {
      for (int64_t i = 0; i < dim; ++i) x[r * dim + i] *= s.embedding_scale;
    }
  });

  // The last layer computes attention, output projection and FFN only for the rows whose logits are wanted: each
  // such row becomes a one-token "sequence" whose context is its own prefix (all of it in the pool by then).
  // When the wanted rows are all rows in order (a decode step), the last layer is like the others.
  scope.emplace(prof, "step setup (row selection, rope tables)");
  const int64_t L = b.num_logits;
  bool all_rows = L == T;
  for (int64_t i = 0; all_rows && i < L; ++i) all_rows = b.logits_indices[i] == i;
  sel_positions_.resize(L);
  sel_query_start_.resize(L + 1);
  sel_seq_lens_.resize(L);
  sel_block_tables_.resize(L * static_cast<int64_t>(b.max_blocks_per_seq));
  sel_lora_slots_.resize(L);
  sel_query_start_[0] = 0;
  for (int64_t i = 0; i < L; ++i) {
    const int32_t row = b.logits_indices[i];
    const int seq = static_cast<int>(std::upper_bound(b.query_start_loc, b.query_start_loc + b.num_seqs + 1, row) -
                                     b.query_start_loc) - 1;
    sel_positions_[i] = b.positions[row];
    sel_lora_slots_[i] = b.lora_slots ? b.lora_slots[row] : -1;
    sel_query_start_[i + 1] = static_cast<int32_t>(i + 1);
    sel_seq_lens_[i] = b.positions[row] + 1;
    std::copy_n(b.block_tables + seq * static_cast<int64_t>(b.max_blocks_per_seq), b.max_blocks_per_seq,
                sel_block_tables_.begin() + i * b.max_blocks_per_seq);
  }
  sel_x_.resize(L * dim);
  sel_xn_.resize(L * dim);
  rope_.compute(pool_, inv_freq_, b.positions, T, s.rope.mscale);
  sel_rope_.compute(pool_, inv_freq_, sel_positions_.data(), L, s.rope.mscale);
  if (s.has_local_rope) {
    rope_local_.compute(pool_, inv_freq_local_, b.positions, T);
    sel_rope_local_.compute(pool_, inv_freq_local_, sel_positions_.data(), L);
  }

  AttentionArgs att;
  att.kv_f16 = s.kv_f16;
  att.num_heads = static_cast<int>(s.num_heads);
  att.num_kv_heads = static_cast<int>(s.num_kv_heads);
  att.head_dim = static_cast<int>(s.head_dim);
  att.block_size = static_cast<int>(s.block_size);
  att.max_blocks_per_seq = b.max_blocks_per_seq;
  att.scale = s.attention_scale != 0.0f ? s.attention_scale : 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  const RopeParams rope_q{static_cast<int>(s.num_heads), static_cast<int>(s.head_dim), s.rope.rope_dim, s.rope.neox};
  const RopeParams rope_k{static_cast<int>(s.num_kv_heads), static_cast<int>(s.head_dim), s.rope.rope_dim,
                          s.rope.neox};

  int64_t rows = T;  // rows carried through the residual stream (T, then L once rows are selected)
  // Each row's LoRA slot (nullptr: no row has an adapter), of the rows carried (b's, then the selected rows').
  const int32_t* lora = b.lora_slots;
  const int32_t* sel_lora = b.lora_slots ? sel_lora_slots_.data() : nullptr;
  for (int64_t l = 0; l < num_layers; ++l) {
    const LayerRefs& W = s.layers[l];
    // The last layer continues with only the selected rows (unless they are all rows).
    const bool select_rows = l == num_layers - 1 && !all_rows;
    scope.emplace(prof, "rmsnorm");
    rmsnorm_rows(x, attn_norm_[l].data(), xn, T);

    // Q, K, V; with row selection Q is needed only for the selected rows.
    // The LoRA products go into the matmuls' jobs (fused_lora), or run after them (CONDUIT_LORA_FUSE=0).
    scope.emplace(prof, "matmul attn_qkv");
    MatmulOutput qkv[3] = {output_of(W.wk, k, kv_dim), output_of(W.wv, v, kv_dim), output_of(W.wq, q, q_dim)};
    const LoraOutput qkv_lora[3] = {{kLoraK, xn, dim, k, kv_dim}, {kLoraV, xn, dim, v, kv_dim}, {kLoraQ, xn, dim, q, q_dim}};
    if (!select_rows) {
      matmul(kt_, pool_, ws_, xn, T, dim, qkv, 3, fused_lora(lora, T, l, qkv_lora, 3));
    } else {
      matmul(kt_, pool_, ws_, xn, T, dim, qkv, 2, fused_lora(lora, T, l, qkv_lora, 2));
      for (int64_t i = 0; i < L; ++i) std::copy_n(xn + b.logits_indices[i] * dim, dim, sel_xn_.data() + i * dim);
      const LoraOutput q_lora{kLoraQ, sel_xn_.data(), dim, q, q_dim};
      matmul(kt_, pool_, ws_, sel_xn_.data(), L, dim, qkv + 2, 1, fused_lora(sel_lora, L, l, &q_lora, 1));
    }
    if (lora && !lora_fuse_) {
      scope.emplace(prof, "lora attn_qkv");
      lora_apply_many(kt_, pool_, lora_plan_, loras_, lora, T, l, qkv_lora, select_rows ? 2 : 3);
      if (select_rows) lora_apply(kt_, pool_, lora_plan_, loras_, sel_lora, L, l, kLoraQ, sel_xn_.data(), dim, q, q_dim);
    }
    // Until the output projection's job opens, the workers mostly wait: the caller applies RoPE, writes the KV cache
    // and, below kAttentionChunk positions of context, runs the attention alone, reading little from memory. The
    // workers request their share of the projection's weights meanwhile, so that share comes from L2 (on a 2-vCPU
    // Xeon the projection took 7.35 us a call instead of 8.26, medians of 9 alternated decode-step runs).
    {
      const MatmulOutput wo = output_of(W.wo, tmp, dim);
      const WeightBytes next = matmul_worker_weights(kt_, pool_, q_dim, &wo, 1);
      pool_.prefetch_while_idle(next.begin, next.bytes);
    }
    const int64_t q_rows = select_rows ? L : T;
    scope.emplace(prof, "bias, rope, kv write");
    if (s.qkv_bias) {
      add_bias(q, bq_[l], q_rows);
      add_bias(k, bk_[l], T);
      add_bias(v, bv_[l], T);
    }
    if (s.qk_norm) {
      rmsnorm_heads(q, q_norm_[l], q_rows, s.num_heads);
      rmsnorm_heads(k, k_norm_[l], T, s.num_kv_heads);
    }
    att.window = s.layer_window.empty() ? 0 : s.layer_window[l];
    const bool local_rope = s.has_local_rope && att.window > 0;
    const RopeTable& rope_rows = local_rope ? rope_local_ : rope_;
    const RopeTable& rope_sel = local_rope ? sel_rope_local_ : sel_rope_;
    apply_rope(kt_, pool_, select_rows ? rope_sel : rope_rows, rope_q, q, q_rows);
    apply_rope(kt_, pool_, rope_rows, rope_k, k, T);

    uint8_t* k_region = s.kv_pool + (2 * l) * region_bytes;
    uint8_t* v_region = s.kv_pool + (2 * l + 1) * region_bytes;
    kv_write(kt_, k, v, T, kv_dim, b.slot_mapping, k_region, v_region, s.kv_f16);

    scope.emplace(prof, "attention");
    att.q = q;
    att.out = attn;
    att.k_cache = k_region;
    att.v_cache = v_region;
    if (!select_rows) {
      att.query_start_loc = b.query_start_loc;
      att.seq_lens = b.seq_lens;
      att.block_tables = b.block_tables;
      attention(kt_, pool_, ws_, att, b.num_seqs);
    } else {
      att.query_start_loc = sel_query_start_.data();
      att.seq_lens = sel_seq_lens_.data();
      att.block_tables = sel_block_tables_.data();
      attention(kt_, pool_, ws_, att, static_cast<int>(L));
      for (int64_t i = 0; i < L; ++i) std::copy_n(x + b.logits_indices[i] * dim, dim, sel_x_.data() + i * dim);
      x = sel_x_.data();
      xn = sel_xn_.data();
      rows = L;
      lora = sel_lora;
    }

    // Attention output projection and residual.
    scope.emplace(prof, "matmul attn_output");
    pool_.prefetch_while_idle(nullptr, 0);  // what is left of the range would only compete with the next weights
    const MatmulOutput wo = output_of(W.wo, tmp, dim);
    const LoraOutput wo_lora{kLoraO, attn, q_dim, tmp, dim};
    matmul(kt_, pool_, ws_, attn, rows, q_dim, &wo, 1, fused_lora(lora, rows, l, &wo_lora, 1));
    if (lora && !lora_fuse_) {
      scope.emplace(prof, "lora attn_output");
      lora_apply(kt_, pool_, lora_plan_, loras_, lora, rows, l, kLoraO, attn, q_dim, tmp, dim);
    }
    if (s.post_norms) {
      scope.emplace(prof, "rmsnorm");
      rmsnorm_rows(tmp, attn_post_norm_[l].data(), tmp, rows);
    }
    scope.emplace(prof, "residual add");
    add_rows(x, tmp, rows, dim);

    // SwiGLU feed-forward (or the experts') and residual.
    scope.emplace(prof, "rmsnorm");
    rmsnorm_rows(x, ffn_norm_[l].data(), xn, rows);
    if (moe_) {
      scope.reset();
      const MoeShape shape{dim, s.expert_ffn_dim, s.n_expert, s.n_expert_used, s.expert_normalize};
      moe_->forward(kt_, pool_, ws_, shape, W, xn, rows, tmp);
      scope.emplace(prof, "residual add");
      add_rows(x, tmp, rows, dim);
      continue;
    }
    scope.emplace(prof, "matmul ffn_gate+up");
    const MatmulOutput gate_up[2] = {output_of(W.w_gate, gate, s.ffn_dim), output_of(W.w_up, up, s.ffn_dim)};
    const LoraOutput gate_up_lora[2] = {{kLoraGate, xn, dim, gate, s.ffn_dim}, {kLoraUp, xn, dim, up, s.ffn_dim}};
    matmul(kt_, pool_, ws_, xn, rows, dim, gate_up, 2, fused_lora(lora, rows, l, gate_up_lora, 2));
    if (lora && !lora_fuse_) {
      scope.emplace(prof, "lora ffn_gate+up");
      lora_apply_many(kt_, pool_, lora_plan_, loras_, lora, rows, l, gate_up_lora, 2);
    }
    scope.emplace(prof, s.gelu ? "geglu" : "swiglu");
    pool_.parallel_for(div_ceil(rows, 16), [&](int64_t item, int) {
      const int64_t r0 = item * 16, r1 = min64(rows, r0 + 16);
      float* g = gate + r0 * s.ffn_dim;
      const float* u = up + r0 * s.ffn_dim;
      const int64_t n = (r1 - r0) * s.ffn_dim;
      if (s.gelu) {
        kt_.geglu(g, u, g, n);  // GELU, tanh approximation (Gemma)
      } else {
        kt_.swiglu(g, u, g, n);
      }
    });
    scope.emplace(prof, "matmul ffn_down");
    const MatmulOutput down = output_of(W.w_down, tmp, dim);
    const LoraOutput down_lora{kLoraDown, gate, s.ffn_dim, tmp, dim};
    matmul(kt_, pool_, ws_, gate, rows, s.ffn_dim, &down, 1, fused_lora(lora, rows, l, &down_lora, 1));
    if (lora && !lora_fuse_) {
      scope.emplace(prof, "lora ffn_down");
      lora_apply(kt_, pool_, lora_plan_, loras_, lora, rows, l, kLoraDown, gate, s.ffn_dim, tmp, dim);
    }
    if (s.post_norms) {
      scope.emplace(prof, "rmsnorm");
      rmsnorm_rows(tmp, ffn_post_norm_[l].data(), tmp, rows);
    }
    scope.emplace(prof, "residual add");
    add_rows(x, tmp, rows, dim);
  }

  // Final norm and logits of the selected rows (x now holds exactly those rows, in order).
  scope.emplace(prof, "rmsnorm");
  rmsnorm_rows(x, output_norm_.data(), xn, L);
  scope.emplace(prof, "matmul output");
  const MatmulOutput out = output_of(s.output, logits, s.vocab_size);
  matmul(kt_, pool_, ws_, xn, L, dim, &out, 1);
  // Between steps the workers wait while the caller samples and schedules: they request their share of the first
  // layer's Q, K and V weights (in the order of the tile list in the loop above), which the next step reads first.
  if (num_layers > 0) {
    const LayerRefs& W = s.layers[0];
    const MatmulOutput qkv[3] = {output_of(W.wk, k, kv_dim), output_of(W.wv, v, kv_dim), output_of(W.wq, q, q_dim)};
    const WeightBytes next = matmul_worker_weights(kt_, pool_, dim, qkv, 3);
    pool_.prefetch_while_idle(next.begin, next.bytes);
  }
  if (s.final_logit_softcap != 0.0f) {
    const float cap = s.final_logit_softcap;
    for (int64_t i = 0; i < L * s.vocab_size; ++i) logits[i] = cap * std::tanh(logits[i] / cap);
  }
}

}  // namespace conduit
