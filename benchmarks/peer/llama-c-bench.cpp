// llama.cpp through its C API, no JavaScript in the loop: the ceiling of what the llama.cpp build bundled with
// node-llama-cpp can do on this machine. Linked against that package's prebuilt libllama / libggml (so the
// same kernels as the node-llama-cpp figures), headers taken from the llama.cpp source the package ships; see
// build-c-bench.mjs. Driven by llama-capi-runner.ts over stdin / stdout.
//
//   llama-c-bench <model.gguf> <ggml backends dir> <threads> <sequences> <context per sequence> <unified kv 0|1>
//
// LLAMA_C_BENCH_LOG=1 keeps llama.cpp's log (stderr), which says which CPU backend variant was loaded.
//
// It runs requests the way llama.cpp's server does: one slot (sequence id) per request in flight, one
// llama_decode per step holding every slot's next tokens in sequence-id order (the sampled token of each
// decoding slot, then prompt chunks up to the batch size), greedy argmax on each slot's logits. A slot keeps its
// KV between requests and reuses the common prefix with the next prompt (all but its last token), as the
// server's cache_prompt does.
//
// Protocol, one command per line on stdin:
//   run <concurrency> <requests>       then one line per request: <max tokens> <prompt length> <token ids...>
//   quit
// Replies on stdout: "ready <description>" once loaded; per run, one line per request
//   trace <index> <submitted ms> <cached tokens> <token ms...>
// (ms since the run command was read, steady clock), then "done"; or "error <message>".
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "llama.h"

namespace {

struct Request {
  int max_tokens = 0;
  std::vector<llama_token> prompt;
};

struct Slot {
  int request = -1;                 // index into the run's requests; -1 when free
  std::vector<llama_token> cached;  // tokens whose K/V this sequence holds, in order
  std::vector<llama_token> pending; // prompt tokens still to evaluate
  llama_token last = 0;             // the latest sampled token, fed on the next step
  int generated = 0;
  int logits_index = -1;            // batch row of this slot's logits in the current step
};

double now_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void add_token(llama_batch& batch, llama_token token, llama_pos pos, llama_seq_id seq, bool logits) {
  const int i = batch.n_tokens++;
  batch.token[i] = token;
  batch.pos[i] = pos;
  batch.n_seq_id[i] = 1;
  batch.seq_id[i][0] = seq;
  batch.logits[i] = logits ? 1 : 0;
}

llama_token argmax(const float* logits, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i) if (logits[i] > logits[best]) best = i;
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s model.gguf backends-dir threads sequences context-per-sequence unified-kv\n", argv[0]);
    return 2;
  }
  const char* model_path = argv[1];
  const int threads = std::atoi(argv[3]);
  const int num_seqs = std::atoi(argv[4]);
  const int ctx_per_seq = std::atoi(argv[5]);
  const bool unified = std::atoi(argv[6]) != 0;
  // One llama_decode call takes up to 2048 tokens (llama.cpp splits it into micro-batches of 512 itself); of the
  // settings tried here (batch 512 or 2048, unified KV or not) this one decodes fastest, one stream or sixteen.
  const int batch_size = 2048;

  if (!std::getenv("LLAMA_C_BENCH_LOG")) llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  ggml_backend_load_all_from_path(argv[2]);  // the CPU backend variants (zen4, sapphirerapids...) are plugins
  llama_backend_init();

  llama_model_params mparams = llama_model_default_params();
  mparams.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(model_path, mparams);
  if (!model) { std::printf("error cannot load %s\n", model_path); return 1; }

  llama_context_params cparams = llama_context_default_params();
  cparams.n_ctx = static_cast<uint32_t>(ctx_per_seq) * num_seqs;
  cparams.n_batch = batch_size;
  cparams.n_seq_max = num_seqs;
  cparams.n_threads = threads;
  cparams.n_threads_batch = threads;
  cparams.kv_unified = unified;
  cparams.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, cparams);
  if (!ctx) { std::printf("error cannot create a context\n"); return 1; }
  llama_memory_t memory = llama_get_memory(ctx);
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  llama_batch batch = llama_batch_init(batch_size, 0, 1);

  std::printf("ready llama.cpp C API, %d threads, %d sequences x %d context, %s KV, flash attention %s\n",
              llama_n_threads(ctx),
              num_seqs, ctx_per_seq, unified ? "unified" : "per-sequence",
              cparams.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_AUTO ? "auto" : "set");
  std::fflush(stdout);

  std::vector<Slot> slots(num_seqs);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream command(line);
    std::string verb;
    command >> verb;
    if (verb == "quit") break;
    if (verb != "run") { std::printf("error unknown command %s\n", verb.c_str()); std::fflush(stdout); continue; }
    int concurrency = 0, count = 0;
    command >> concurrency >> count;
    std::vector<Request> requests(count);
    for (auto& r : requests) {
      std::getline(std::cin, line);
      std::istringstream in(line);
      size_t length = 0;
      in >> r.max_tokens >> length;
      r.prompt.resize(length);
      for (auto& t : r.prompt) in >> t;
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (concurrency < 1 || concurrency > num_seqs) {
      std::printf("error concurrency %d outside 1..%d\n", concurrency, num_seqs);
      std::fflush(stdout);
      continue;
    }
    std::vector<double> submitted(count);
    std::vector<int> cached_tokens(count);
    std::vector<std::vector<double>> token_ms(count);
    int next = 0;
    auto assign = [&](int s) {
      Slot& slot = slots[s];
      const int i = next++;
      const auto& prompt = requests[i].prompt;
      size_t kept = 0;
      while (kept < slot.cached.size() && kept + 1 < prompt.size() && slot.cached[kept] == prompt[kept]) ++kept;
      llama_memory_seq_rm(memory, s, static_cast<llama_pos>(kept), -1);
      slot.cached.resize(kept);
      slot.pending.assign(prompt.begin() + kept, prompt.end());
      slot.request = i;
      slot.generated = 0;
      submitted[i] = now_ms(t0);
      cached_tokens[i] = static_cast<int>(kept);
    };
    for (int s = 0; s < concurrency && next < count; ++s) assign(s);

    bool failed = false;
    for (;;) {
      int num_decoding = 0, num_active = 0;
      for (int s = 0; s < concurrency; ++s) {
        if (slots[s].request < 0) continue;
        ++num_active;
        if (slots[s].pending.empty()) ++num_decoding;
      }
      if (num_active == 0) break;
      int prefill_budget = batch_size - num_decoding;
      batch.n_tokens = 0;
      for (int s = 0; s < concurrency; ++s) {  // sequence-id order
        Slot& slot = slots[s];
        slot.logits_index = -1;
        if (slot.request < 0) continue;
        if (slot.pending.empty()) {
          slot.logits_index = batch.n_tokens;
          add_token(batch, slot.last, static_cast<llama_pos>(slot.cached.size()), s, true);
          slot.cached.push_back(slot.last);
        } else if (prefill_budget > 0) {
          const int take = std::min<int>(prefill_budget, static_cast<int>(slot.pending.size()));
          const bool ends_prompt = take == static_cast<int>(slot.pending.size());
          for (int k = 0; k < take; ++k) {
            const bool logits = ends_prompt && k == take - 1;
            if (logits) slot.logits_index = batch.n_tokens;
            add_token(batch, slot.pending[k], static_cast<llama_pos>(slot.cached.size()), s, logits);
            slot.cached.push_back(slot.pending[k]);
          }
          slot.pending.erase(slot.pending.begin(), slot.pending.begin() + take);
          prefill_budget -= take;
        }
      }
      const int rc = llama_decode(ctx, batch);
      if (rc != 0) { std::printf("error llama_decode returned %d\n", rc); failed = true; break; }
      for (int s = 0; s < concurrency; ++s) {
        Slot& slot = slots[s];
        if (slot.logits_index < 0) continue;
        slot.last = argmax(llama_get_logits_ith(ctx, slot.logits_index), n_vocab);
        token_ms[slot.request].push_back(now_ms(t0));
        if (++slot.generated == requests[slot.request].max_tokens) {
          slot.request = -1;
          if (next < count) assign(s);
        }
      }
    }
    if (!failed) {
      for (int i = 0; i < count; ++i) {
        std::printf("trace %d %.4f %d", i, submitted[i], cached_tokens[i]);
        for (double t : token_ms[i]) std::printf(" %.4f", t);
        std::printf("\n");
      }
      std::printf("done\n");
    }
    std::fflush(stdout);
  }
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
