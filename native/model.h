// A Llama-family model held by the addon: pointers into weight bytes owned by JavaScript (never modified; the
// binding keeps the arrays referenced), copies of the matrices in their kernel's load-time packed layout where it
// has one, the paged KV pool, a thread pool and scratch buffers. `forward` runs one engine step: embeddings, every
// layer, the logits of the requested rows.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "compute.h"
#include "lora.h"
#include "memory.h"
#include "sample_draw.h"

namespace conduit {

class MoeBlock;

// A weight matrix [rows x cols] (cols contiguous, ggml shape [cols, rows]) or a vector (rows = 1).
struct TensorRef {
  const uint8_t* data = nullptr;
  int type = kF32;
  int64_t cols = 0, rows = 0;
  const uint8_t* packed = nullptr;  // the kernel's load-time layout of a matrix, when it has one (owned by Model)
};

struct LayerRefs {
  TensorRef attn_norm, wq, wk, wv, wo, bq, bk, bv, ffn_norm, w_gate, w_up, w_down;
  TensorRef q_norm, k_norm;  // per-head RMS norm weights of Q and K (qk_norm)
  TensorRef attn_post_norm, ffn_post_norm;  // norms of the attention and feed-forward outputs (post_norms)
  // Mixture of experts: the router [dim -> n_expert], and w_gate / w_up / w_down hold every expert's matrix stacked
  // (rows = n_expert * rows of one expert); the model slices them into one TensorRef per expert at load.
  TensorRef gate_inp;
  std::vector<TensorRef> gate_exps, up_exps, down_exps;
};

struct ModelSpec {
  int64_t vocab_size = 0, dim = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, ffn_dim = 0;
  float rms_norm_eps = 1e-5f;
  RopeConfig rope;
  bool qkv_bias = false;
  bool qk_norm = false;
  // Experts per layer (0: the dense SwiGLU block), used per row, each expert's intermediate size, top-k renormalized.
  int64_t n_expert = 0, n_expert_used = 0, expert_ffn_dim = 0;
  bool expert_normalize = true;
  // Sliding window of each layer (0: full causal attention); empty: no layer has one.
  std::vector<int> layer_window;
  // The sliding-window layers rotate with their own RoPE (Gemma 3's local layers), the others with `rope`.
  bool has_local_rope = false;
  RopeConfig rope_local;
  // Gemma: embeddings times embedding_scale (0: not scaled), RMS norms of each block's output before its residual
  // add, GELU-tanh instead of SiLU in the gated feed-forward, the score scale (0: 1 / sqrt(head_dim)) and the final
  // logit softcap (0: none).
  float embedding_scale = 0.0f;
  bool post_norms = false;
  bool gelu = false;
  float attention_scale = 0.0f;
  float final_logit_softcap = 0.0f;
  TensorRef token_embedding, output_norm, output;
  std::vector<LayerRefs> layers;
  // Paged KV pool (see src/kernels/types.ts KvPoolLayout).
  uint8_t* kv_pool = nullptr;
  size_t kv_pool_bytes = 0;
  int64_t num_blocks = 0, block_size = 0;
  bool kv_f16 = false;
  // Repack matrices into their kernel's load-time layout where it has one (off: stream the ggml rows, for
  // comparisons).
  bool pack_weights = true;
  // Once packed, give the ggml bytes of the packed matrices back to the system (the caller promises nothing reads
  // them again; the embedding table is kept, also when the output matrix shares it). Halves the weights' memory.
  bool release_unpacked = false;
  // For tests only: scratch growth that would take the model's per-step buffers past this many bytes fails as an
  // allocation failure (std::bad_alloc) would. 0: no limit.
  size_t scratch_limit_bytes = 0;
};

// One engine step (src/kernels/types.ts ForwardBatch), lengths already checked by the caller.
struct StepBatch {
  int64_t num_tokens = 0;
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int32_t* slot_mapping = nullptr;
  int num_seqs = 0;
  const int32_t* query_start_loc = nullptr;
  const int32_t* seq_lens = nullptr;
  const int32_t* block_tables = nullptr;
  int max_blocks_per_seq = 0;
  const int32_t* logits_indices = nullptr;
  int64_t num_logits = 0;
  // [num_tokens] LoRA adapter slot of each row (-1: the base model), or nullptr when no row has one.
  const int32_t* lora_slots = nullptr;
};

// Bad input from the caller: the binding turns it into a JavaScript error with this message.
struct InvalidInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Model {
 public:
  // Checks the spec (shapes, types) and throws InvalidInput naming the problem.
  Model(ModelSpec spec, Variant variant, int threads);

  // Validates the batch against the pool and the model, then writes num_logits x vocab_size floats to `logits`.
  void forward(const StepBatch& batch, float* logits);

  const ModelSpec& spec() const { return spec_; }
  Variant variant() const { return variant_; }
  // The greedy token of one logits row with this model's kernels (KernelTable::argmax: -1 for NaN / all -inf).
  int64_t argmax(const float* row, int64_t n) const { return kt_.argmax(row, n); }
  // The kernels of this model's variant (the sampler's weighing pass runs with them).
  const KernelTable& kernels() const { return kt_; }
  // The sampler's prompt-logprob pass (Sampler.promptLogprob) over `rows` logits rows of vocab_size floats at once,
  // rows spread over the pool's threads: for row r, out[3r] = its argmax id (KernelTable::argmax: -1 for a NaN or
  // nothing above -inf; the other two are then 0), out[3r + 1] = the weighing pass's total at scale 1 from that max
  // with no floor, out[3r + 2] = how many values are greater than row[targets[r]]; and best[r * num_best ..] = the
  // row's num_best best ids (min(num_best, vocab_size) of them), best first, the lower id first among equal values
  // (the sampler's bestIds). With row_ids, entry r is of logits row row_ids[r] instead of row r (the caller checks
  // each is a row of logits). Throws InvalidInput for a target outside the vocabulary.
  void prompt_logprob_rows(const float* logits, int64_t rows, const int32_t* targets, double* out, int32_t* best,
                           int64_t num_best, const int32_t* row_ids = nullptr);
  // The sampler's random draws of `count` rows at once, spread over the pool's threads: entry i draws logits row
  // rows[i] (of vocab_size floats; the caller checks it is one) by specs[i * sample::kDrawSpecWords ..]
  // (sample_draw.h) into out[i], -1 for a row with a NaN or nothing above -inf.
  void sample_rows(const float* logits, int64_t count, const int32_t* rows, const double* specs, int32_t* out);
  int threads() const { return pool_.size(); }
  // Weight bytes moved onto huge pages at load (see memory.h), packed copies included.
  size_t huge_page_bytes() const { return huge_page_bytes_; }
  // Memory held by packed copies of the weights (in addition to the JavaScript-owned ggml bytes).
  size_t packed_weight_bytes() const { return packed_bytes_; }
  // ggml bytes of packed matrices given back to the system at load (release_unpacked).
  size_t released_weight_bytes() const { return released_bytes_; }

  // Bytes of the per-step buffers, which grow to the largest step so far and are kept: the layer activations (the
  // residual stream, normed copy, Q, K, V, attention output, FFN gate and up, for every row of the step) and the
  // rest of the scratch (quantized matmul inputs, per-thread kernel scratch, RoPE tables, the last layer's
  // selected rows, MoE grouping buffers).
  size_t activation_bytes() const;
  size_t workspace_bytes() const;
  // Bytes of the LoRA adapters loaded into slots (setLora).
  size_t lora_bytes() const { return loras_.bytes(); }

  // Gives the KV pool's pages back to the system (see memory.h release_pages); the caller promises no block holds
  // K/V a later forward reads (a forward writes a slot before any step reads it). Returns the bytes released.
  size_t release_kv_pool() { return release_pages(spec_.kv_pool, spec_.kv_pool_bytes); }
  // Bytes of the KV pool resident in memory now.
  size_t kv_pool_resident_bytes() const { return resident_bytes(spec_.kv_pool, spec_.kv_pool_bytes); }

  // Puts a LoRA adapter into a slot, or empties the slot (nullptr). The adapter's matrices must fit this model
  // (checked here: InvalidInput names the mismatch).
  void set_lora(int slot, std::unique_ptr<LoraAdapter> adapter);

  // Per-section wall time of forward passes (plus the pool's hand-over waits) while enabled; take_profile
  // returns what was gathered since the last call and starts again.
  void set_profiling(bool on);
  Profile take_profile();

 private:
  void validate(const StepBatch& b) const;
  void ensure_buffers(int64_t tokens);
  // Rows [0, rows) of each matrix: y_i = norm(x_i) for each row.
  void rmsnorm_rows(const float* x, const float* weight, float* out, int64_t rows);
  void add_rows(float* acc, const float* x, int64_t rows, int64_t width);
  void add_bias(float* y, const std::vector<float>& bias, int64_t rows);
  void pack_weights();
  MatmulOutput output_of(const TensorRef& t, float* y, int64_t ldy) const;

  ModelSpec spec_;
  Variant variant_;
  size_t huge_page_bytes_ = 0;
  size_t released_bytes_ = 0;
  struct FreePacked {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, FreePacked> packed_;
  size_t packed_bytes_ = 0;
  Profile profile_;
  const KernelTable& kt_;
  ThreadPool pool_;
  Workspace ws_;
  std::vector<double> inv_freq_;
  // Norm weights and biases in f32 (tiny; whatever type the file stored them in).
  std::vector<std::vector<float>> attn_norm_, ffn_norm_, bq_, bk_, bv_, q_norm_, k_norm_, attn_post_norm_, ffn_post_norm_;
  std::vector<double> inv_freq_local_;
  // Per-head RMS norm of rows x heads vectors of head_dim, in place.
  void rmsnorm_heads(float* x, const std::vector<float>& weight, int64_t rows, int64_t heads);
  struct FreeMoe {
    void operator()(MoeBlock* p) const;
  };
  std::unique_ptr<MoeBlock, FreeMoe> moe_;
  std::vector<float> output_norm_;
  // Activations, sized for the largest step so far.
  int64_t capacity_tokens_ = 0;
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, tmp_;
  // The last layer only needs the rows whose logits are wanted (plus K/V of every row).
  std::vector<float> sel_x_, sel_xn_;
  // prompt_logprob_rows' weights, vocab_size doubles per thread (allocated on first use).
  std::vector<double> prompt_weights_;
  // sample_rows' scratch, one per thread (each grown to the vocabulary on first use).
  std::vector<sample::DrawScratch> draw_scratch_;
  std::vector<int32_t> sel_positions_, sel_query_start_, sel_seq_lens_, sel_block_tables_, sel_lora_slots_;
  LoraSet loras_;
  // The LoRA products of the matmul being run (reused), and whether they run in its jobs (lora.h lora_fuse_enabled).
  LoraPlan lora_plan_;
  bool lora_fuse_ = lora_fuse_enabled();
  // Plans the LoRA products of a matmul's outputs for the rows' slots (null slots: none); the plan to pass to
  // matmul, or null when the products are not fused or there are none.
  const LoraPlan* fused_lora(const int32_t* slots, int64_t rows, int64_t layer, const LoraOutput* outputs, int count);
  RopeTable rope_, sel_rope_;  // cos/sin of this step's rows, and of the selected rows
  RopeTable rope_local_, sel_rope_local_;  // the same for the sliding-window layers' own RoPE (has_local_rope)
};

}  // namespace conduit
