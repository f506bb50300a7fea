// The JavaScript face of the addon (typed in src/kernels/native.ts):
//   cpuInfo()                       features, best variant
//   kernelVariants(variant)         kernel kind -> variant serving it
//   NativeModel                     a loaded model with its KV pool: forward(batch), info(), setProfiling(on),
//                                   takeProfile(), dispose()
//   ops.*                           one entry per kernel with an explicit variant, for the test harness, and the
//                                   software AMX model on its own (amxModel): addon_ops.cc
//   bench.*                         machine limits (memory bandwidth, peak FLOP/s) for the roofline
//   crc32c(bytes, crc?, portable?)  CRC-32C of a Uint8Array (continuing crc), the KV transfer's checksum
//   crc32cCopy(src, dst, off, crc?, uncached?)  the same of src, copying it into dst at off in the same pass
//   crc32cCopyRuns(src, dst, plan, count, uncached?)  crc32cCopy of `count` ranges of src in one call
//   crc32cPath(path?)               the CRC-32C path in use and those this CPU runs; switches it for the process
//   shmMap(path, bytes, create), shmUnmap(buffer)  a shared-memory file mapped as an ArrayBuffer (shm_region.h)
#include <napi.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "addon_args.h"
#include "addon_ops.h"
#include "bench.h"
#include "checksum.h"
#include "cpu.h"
#include "crash_handler.h"
#include "model.h"
#include "shm_region.h"

using namespace conduit;
using namespace conduit::addon;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Module functions

// crc32c(bytes: Uint8Array, crc = 0, portable = false): CRC-32C continuing `crc`; portable forces the table version.
Napi::Value Crc32c(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  ArrayView bytes = typed_array(env, info[0], napi_uint8_array, "bytes");
  uint32_t crc = 0;
  if (info.Length() > 1 && !info[1].IsUndefined()) {
    const int64_t value = integer(env, info[1], "crc");
    if (value > 0xFFFFFFFFll) throw Napi::RangeError::New(env, "crc must be a 32-bit unsigned integer");
    crc = static_cast<uint32_t>(value);
  }
  const bool portable = info.Length() > 2 && info[2].ToBoolean().Value();
  const uint8_t* data = static_cast<const uint8_t*>(bytes.data);
  return Napi::Number::New(env, portable ? crc32c_portable(crc, data, bytes.length) : crc32c(crc, data, bytes.length));
}

// crc32cCopy(src: Uint8Array, dst: Uint8Array, dstOffset: number, crc = 0, uncached = false): copies src into dst at
// dstOffset and returns CRC-32C of src continuing `crc`, in one pass (checksum.h).
Napi::Value Crc32cCopy(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  ArrayView src = typed_array(env, info[0], napi_uint8_array, "src");
  ArrayView dst = typed_array(env, info[1], napi_uint8_array, "dst");
  const int64_t offset = integer(env, info[2], "dstOffset");
  if (offset < 0 || static_cast<uint64_t>(offset) > dst.length || src.length > dst.length - static_cast<size_t>(offset)) {
    throw Napi::RangeError::New(env, "src does not fit in dst at dstOffset");
  }
  uint32_t crc = 0;
  if (info.Length() > 3 && !info[3].IsUndefined()) {
    const int64_t value = integer(env, info[3], "crc");
    if (value > 0xFFFFFFFFll) throw Napi::RangeError::New(env, "crc must be a 32-bit unsigned integer");
    crc = static_cast<uint32_t>(value);
  }
  const uint8_t* from = static_cast<const uint8_t*>(src.data);
  uint8_t* to = static_cast<uint8_t*>(dst.data) + offset;
  const uintptr_t a = reinterpret_cast<uintptr_t>(from), b = reinterpret_cast<uintptr_t>(to);
  if (src.length > 0 && a < b + src.length && b < a + src.length) {
    throw Napi::RangeError::New(env, "src and dst overlap");
  }
  const bool uncached = info.Length() > 4 && info[4].ToBoolean().Value();
  return Napi::Number::New(env, crc32c_copy(crc, from, to, src.length, uncached));
}

// crc32cCopyRuns(src: Uint8Array, dst: Uint8Array, plan: Float64Array, count: number, uncached = false): for each of
// the first `count` entries of plan, [srcOffset, dstOffset, length, crc], copies src[srcOffset, +length) into dst at
// dstOffset and replaces the entry's crc with CRC-32C of those bytes continuing it: the block runs of a KV transfer's
// read, or of a pack being written, in one call instead of one each. Every entry is checked before any is copied.
Napi::Value Crc32cCopyRuns(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  ArrayView src = typed_array(env, info[0], napi_uint8_array, "src");
  ArrayView dst = typed_array(env, info[1], napi_uint8_array, "dst");
  ArrayView plan_view = typed_array(env, info[2], napi_float64_array, "plan");
  const int64_t count = integer(env, info[3], "count");
  if (static_cast<uint64_t>(count) > plan_view.length / 4) throw Napi::RangeError::New(env, "count is over the plan's entries");
  const bool uncached = info.Length() > 4 && info[4].ToBoolean().Value();
  double* plan = static_cast<double*>(plan_view.data);
  const uint8_t* from = static_cast<const uint8_t*>(src.data);
  uint8_t* to = static_cast<uint8_t*>(dst.data);
  auto whole = [](double d, double limit) { return d >= 0 && d <= limit && d == static_cast<double>(static_cast<uint64_t>(d)); };
  // The entries are checked and run from a copy: the plan's own memory (a view of dst, or shared with another
  // thread) could otherwise change an entry between its check and its copy.
  std::vector<double> checked(plan, plan + 4 * count);
  for (int64_t i = 0; i < count; i++) {
    const double* e = checked.data() + 4 * i;
    if (!whole(e[2], 9.0e15) || !whole(e[0], static_cast<double>(src.length) - e[2]) || !whole(e[1], static_cast<double>(dst.length) - e[2])) {
      throw Napi::RangeError::New(env, "plan entry " + std::to_string(i) + " does not fit in src and dst");
    }
    if (!whole(e[3], 4294967295.0)) throw Napi::RangeError::New(env, "plan entry " + std::to_string(i) + ": crc must be a 32-bit unsigned integer");
    const size_t n = static_cast<size_t>(e[2]);
    const uintptr_t a = reinterpret_cast<uintptr_t>(from + static_cast<size_t>(e[0]));
    const uintptr_t b = reinterpret_cast<uintptr_t>(to + static_cast<size_t>(e[1]));
    if (n > 0 && a < b + n && b < a + n) throw Napi::RangeError::New(env, "plan entry " + std::to_string(i) + ": src and dst overlap");
  }
  for (int64_t i = 0; i < count; i++) {
    const double* e = checked.data() + 4 * i;
    plan[4 * i + 3] = static_cast<double>(crc32c_copy(static_cast<uint32_t>(e[3]), from + static_cast<size_t>(e[0]),
                                                      to + static_cast<size_t>(e[1]), static_cast<size_t>(e[2]), uncached));
  }
  return env.Undefined();
}

// crc32cPath(path?: string): switches every CRC-32C call of the process (crc32c, crc32cCopy, crc32cCopyRuns) to
// path ('table', 'sse42', 'clmul256' or 'clmul'; RangeError for one this CPU does not run), then returns {path, supported}.
Napi::Value Crc32cPathInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() > 0 && !info[0].IsUndefined()) {
    if (!info[0].IsString()) throw Napi::TypeError::New(env, "path must be a string");
    const std::string name = info[0].As<Napi::String>().Utf8Value();
    if (!crc32c_set_path(name.c_str())) {
      throw Napi::RangeError::New(env, "'" + name + "' is not a CRC-32C path this CPU runs");
    }
  }
  Napi::Object out = Napi::Object::New(env);
  out.Set("path", crc32c_path_name(crc32c_path()));
  Napi::Array supported = Napi::Array::New(env);
  for (int i = 0; i < kNumCrc32cPaths; i++) {
    const Crc32cPath path = static_cast<Crc32cPath>(i);
    if (crc32c_path_supported(path)) supported.Set(supported.Length(), crc32c_path_name(path));
  }
  out.Set("supported", supported);
  return out;
}

Napi::Value CpuInfo(const Napi::CallbackInfo& info) {
  const CpuFeatures& f = cpu_features();
  Napi::Object out = Napi::Object::New(info.Env());
  out.Set("avx2", f.avx2);
  out.Set("fma", f.fma);
  out.Set("f16c", f.f16c);
  out.Set("avx512f", f.avx512f);
  out.Set("avx512bw", f.avx512bw);
  out.Set("avx512vl", f.avx512vl);
  out.Set("avx512dq", f.avx512dq);
  out.Set("avx512vnni", f.avx512vnni);
  out.Set("avx512bf16", f.avx512bf16);
  out.Set("amxTile", f.amx_tile);
  out.Set("amxInt8", f.amx_int8);
  out.Set("amxBf16", f.amx_bf16);
  out.Set("amxPermitted", f.amx_permitted);
  out.Set("amxStatus", f.amx_status);
  out.Set("bestVariant", variant_name(best_supported_variant()));
  Napi::Array verification = Napi::Array::New(info.Env());
  if (variant_supported(Variant::AmxModel)) verification.Set(0u, variant_name(Variant::AmxModel));
  out.Set("verificationVariants", verification);
  out.Set("defaultThreads", default_thread_count());
  return out;
}

Napi::Value KernelVariants(const Napi::CallbackInfo& info) {
  return variants_object(info.Env(), variant_arg(info.Env(), info[0]));
}

// ---------------------------------------------------------------------------------------------------------------
// NativeModel

class NativeModel : public Napi::ObjectWrap<NativeModel> {
 public:
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "NativeModel",
                       {InstanceMethod("forward", &NativeModel::Forward), InstanceMethod("info", &NativeModel::Info),
                        InstanceMethod("setProfiling", &NativeModel::SetProfiling),
                        InstanceMethod("takeProfile", &NativeModel::TakeProfile),
                        InstanceMethod("releaseKvPool", &NativeModel::ReleaseKvPool),
                        InstanceMethod("argmax", &NativeModel::Argmax),
                        InstanceMethod("sampleWeigh", &NativeModel::SampleWeigh),
                        InstanceMethod("scaleRow", &NativeModel::ScaleRow),
                        InstanceMethod("promptLogprobRows", &NativeModel::PromptLogprobRows),
                        InstanceMethod("sampleRows", &NativeModel::SampleRows),
                        InstanceMethod("kvPoolResidentBytes", &NativeModel::KvPoolResidentBytes),
                        InstanceMethod("memoryInfo", &NativeModel::MemoryInfo),
                        InstanceMethod("setLora", &NativeModel::SetLora),
                        InstanceMethod("dispose", &NativeModel::Dispose)});
  }

  // new NativeModel(spec): see NativeModelSpec in src/kernels/native.ts.
  explicit NativeModel(const Napi::CallbackInfo& info) : Napi::ObjectWrap<NativeModel>(info) {
    Napi::Env env = info.Env();
    if (!info[0].IsObject()) throw Napi::TypeError::New(env, "NativeModel needs a spec object");
    Napi::Object spec = info[0].As<Napi::Object>();
    ModelSpec s;
    s.vocab_size = integer(env, spec.Get("vocabSize"), "vocabSize", 1);
    s.dim = integer(env, spec.Get("dim"), "dim", 1);
    s.num_heads = integer(env, spec.Get("numHeads"), "numHeads", 1);
    s.num_kv_heads = integer(env, spec.Get("numKvHeads"), "numKvHeads", 1);
    s.head_dim = integer(env, spec.Get("headDim"), "headDim", 1);
    s.ffn_dim = integer(env, spec.Get("ffnDim"), "ffnDim", 1);
    s.rms_norm_eps = static_cast<float>(number(env, spec.Get("rmsNormEps"), "rmsNormEps"));
    s.qkv_bias = spec.Get("qkvBias").ToBoolean();
    s.qk_norm = spec.Get("qkNorm").ToBoolean();
    if (!spec.Get("moe").IsUndefined()) {
      if (!spec.Get("moe").IsObject()) throw Napi::TypeError::New(env, "moe must be an object");
      Napi::Object moe = spec.Get("moe").As<Napi::Object>();
      s.n_expert = integer(env, moe.Get("numExperts"), "moe.numExperts", 1);
      s.n_expert_used = integer(env, moe.Get("numExpertsUsed"), "moe.numExpertsUsed", 1);
      s.expert_ffn_dim = integer(env, moe.Get("expertFfnDim"), "moe.expertFfnDim", 1);
      s.expert_normalize = moe.Get("normalizeTopK").ToBoolean();
    }
    s.rope.theta = number(env, spec.Get("ropeTheta"), "ropeTheta");
    s.rope.rope_dim = static_cast<int>(integer(env, spec.Get("ropeDim"), "ropeDim", 2));
    s.rope.neox = spec.Get("ropeNeox").ToBoolean();
    read_rope_scaling(env, spec.Get("ropeScaling"), &s.rope);
    if (!spec.Get("layerWindows").IsUndefined()) {
      if (!spec.Get("layerWindows").IsArray()) throw Napi::TypeError::New(env, "layerWindows must be an array");
      Napi::Array windows = spec.Get("layerWindows").As<Napi::Array>();
      for (uint32_t i = 0; i < windows.Length(); ++i) {
        s.layer_window.push_back(static_cast<int>(integer(env, windows.Get(i), "layerWindows[]", 0)));
      }
    }
    if (!spec.Get("ropeLocalTheta").IsUndefined()) {
      // The local layers' RoPE: the same pairing and dimensions, their own base, no scaling.
      s.has_local_rope = true;
      s.rope_local.theta = number(env, spec.Get("ropeLocalTheta"), "ropeLocalTheta");
      s.rope_local.rope_dim = s.rope.rope_dim;
      s.rope_local.neox = s.rope.neox;
    }
    if (!spec.Get("embeddingScale").IsUndefined()) {
      s.embedding_scale = static_cast<float>(number(env, spec.Get("embeddingScale"), "embeddingScale"));
    }
    s.post_norms = spec.Get("postNorms").ToBoolean();
    s.gelu = spec.Get("geluFfn").ToBoolean();
    if (!spec.Get("attentionScale").IsUndefined()) {
      s.attention_scale = static_cast<float>(number(env, spec.Get("attentionScale"), "attentionScale"));
    }
    if (!spec.Get("finalLogitSoftcap").IsUndefined()) {
      s.final_logit_softcap = static_cast<float>(number(env, spec.Get("finalLogitSoftcap"), "finalLogitSoftcap"));
    }

    s.token_embedding = tensor(env, spec.Get("tokenEmbedding"), "tokenEmbedding");
    s.output_norm = tensor(env, spec.Get("outputNorm"), "outputNorm");
    s.output = tensor(env, spec.Get("output"), "output");
    if (!spec.Get("layers").IsArray()) throw Napi::TypeError::New(env, "layers must be an array");
    Napi::Array layers = spec.Get("layers").As<Napi::Array>();
    for (uint32_t i = 0; i < layers.Length(); ++i) {
      const std::string p = "layers[" + std::to_string(i) + "].";
      if (!layers.Get(i).IsObject()) throw Napi::TypeError::New(env, p.substr(0, p.size() - 1) + " must be an object");
      Napi::Object l = layers.Get(i).As<Napi::Object>();
      LayerRefs r;
      r.attn_norm = tensor(env, l.Get("attnNorm"), p + "attnNorm");
      r.wq = tensor(env, l.Get("wq"), p + "wq");
      r.wk = tensor(env, l.Get("wk"), p + "wk");
      r.wv = tensor(env, l.Get("wv"), p + "wv");
      r.wo = tensor(env, l.Get("wo"), p + "wo");
      if (s.qkv_bias) {
        r.bq = tensor(env, l.Get("bq"), p + "bq");
        r.bk = tensor(env, l.Get("bk"), p + "bk");
        r.bv = tensor(env, l.Get("bv"), p + "bv");
      }
      if (s.qk_norm) {
        r.q_norm = tensor(env, l.Get("qNorm"), p + "qNorm");
        r.k_norm = tensor(env, l.Get("kNorm"), p + "kNorm");
      }
      if (s.n_expert > 0) r.gate_inp = tensor(env, l.Get("ffnGateInp"), p + "ffnGateInp");
      if (s.post_norms) {
        r.attn_post_norm = tensor(env, l.Get("attnPostNorm"), p + "attnPostNorm");
        r.ffn_post_norm = tensor(env, l.Get("ffnPostNorm"), p + "ffnPostNorm");
      }
      r.ffn_norm = tensor(env, l.Get("ffnNorm"), p + "ffnNorm");
      r.w_gate = tensor(env, l.Get("wGate"), p + "wGate");
      r.w_up = tensor(env, l.Get("wUp"), p + "wUp");
      r.w_down = tensor(env, l.Get("wDown"), p + "wDown");
      s.layers.push_back(r);
    }

    ArrayView pool = typed_array(env, spec.Get("kvPool"), napi_uint8_array, "kvPool");
    keep_.push_back(Napi::Persistent(spec.Get("kvPool").As<Napi::Object>()));
    s.kv_pool = static_cast<uint8_t*>(pool.data);
    s.kv_pool_bytes = pool.length;
    s.num_blocks = integer(env, spec.Get("numBlocks"), "numBlocks", 1);
    s.block_size = integer(env, spec.Get("blockSize"), "blockSize", 1);
    const std::string dtype = spec.Get("kvDtype").ToString().Utf8Value();
    if (dtype != "f32" && dtype != "f16") throw Napi::TypeError::New(env, "kvDtype must be 'f32' or 'f16'");
    s.kv_f16 = dtype == "f16";
    s.pack_weights = spec.Get("packWeights").IsUndefined() || spec.Get("packWeights").ToBoolean();
    s.release_unpacked = spec.Get("releaseUnpackedWeights").ToBoolean();
    if (!spec.Get("scratchLimitBytes").IsUndefined()) {
      s.scratch_limit_bytes = static_cast<size_t>(integer(env, spec.Get("scratchLimitBytes"), "scratchLimitBytes", 0));
    }

    const Variant variant = run_variant_arg(env, spec.Get("variant"));
    const int threads = static_cast<int>(integer(env, spec.Get("threads"), "threads", 1));
    try {
      model_ = std::make_unique<Model>(std::move(s), variant, threads);
    } catch (const InvalidInput& e) {
      throw Napi::Error::New(env, e.what());
    } catch (const std::bad_alloc&) {
      throw allocation_failed(env, "NativeModel: out of memory while loading the model (the packed weight copy)");
    }
  }

 private:
  // A tensor argument { type, shape: [cols, rows?], data: Uint8Array }; its array stays referenced.
  TensorRef tensor(const Napi::Env& env, const Napi::Value& value, const std::string& name) {
    if (!value.IsObject()) throw Napi::TypeError::New(env, name + " is missing");
    Napi::Object t = value.As<Napi::Object>();
    TensorRef r;
    r.type = weight_type_arg(env, t.Get("type"), name + ".type");
    if (!t.Get("shape").IsArray()) throw Napi::TypeError::New(env, name + ".shape must be an array");
    Napi::Array shape = t.Get("shape").As<Napi::Array>();
    if (shape.Length() < 1 || shape.Length() > 2) throw Napi::RangeError::New(env, name + " must be 1-D or 2-D");
    r.cols = integer(env, shape.Get(0u), name + ".shape[0]", 1);
    r.rows = shape.Length() == 2 ? integer(env, shape.Get(1u), name + ".shape[1]", 1) : 1;
    if (r.cols % type_block_elements(r.type) != 0) {
      throw Napi::RangeError::New(env, name + ": row length " + std::to_string(r.cols) +
                                           " is not a multiple of the block size");
    }
    ArrayView data = typed_array(env, t.Get("data"), napi_uint8_array, name + ".data");
    const size_t needed = row_bytes(r.type, r.cols) * static_cast<size_t>(r.rows);
    if (data.length < needed) {
      throw Napi::RangeError::New(env, name + ".data has " + std::to_string(data.length) + " bytes, needs " +
                                           std::to_string(needed));
    }
    r.data = static_cast<const uint8_t*>(data.data);
    keep_.push_back(Napi::Persistent(t.Get("data").As<Napi::Object>()));
    return r;
  }

  Model& model(const Napi::Env& env) {
    if (!model_) throw Napi::Error::New(env, "NativeModel is disposed");
    return *model_;
  }

  // forward(batch: ForwardBatch, out?: Float32Array) -> Float32Array [logitsIndices.length * vocabSize]
  Napi::Value Forward(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Model& m = model(env);
    note_kernel_variant(variant_name(m.variant()));
    if (!info[0].IsObject()) throw Napi::TypeError::New(env, "forward needs a batch object");
    Napi::Object o = info[0].As<Napi::Object>();
    StepBatch b;
    b.num_tokens = integer(env, o.Get("numTokens"), "numTokens");
    b.num_seqs = static_cast<int>(integer(env, o.Get("numSeqs"), "numSeqs"));
    b.max_blocks_per_seq = static_cast<int>(integer(env, o.Get("maxBlocksPerSeq"), "maxBlocksPerSeq"));
    const size_t T = static_cast<size_t>(b.num_tokens), S = static_cast<size_t>(b.num_seqs);
    b.token_ids = typed_data<int32_t>(env, o.Get("tokenIds"), napi_int32_array, "tokenIds", T);
    b.positions = typed_data<int32_t>(env, o.Get("positions"), napi_int32_array, "positions", T);
    b.slot_mapping = typed_data<int32_t>(env, o.Get("slotMapping"), napi_int32_array, "slotMapping", T);
    b.query_start_loc = typed_data<int32_t>(env, o.Get("queryStartLoc"), napi_int32_array, "queryStartLoc", S + 1);
    b.seq_lens = typed_data<int32_t>(env, o.Get("seqLens"), napi_int32_array, "seqLens", S);
    b.block_tables = typed_data<int32_t>(env, o.Get("blockTables"), napi_int32_array, "blockTables",
                                         S * static_cast<size_t>(b.max_blocks_per_seq));
    ArrayView logits_indices = typed_array(env, o.Get("logitsIndices"), napi_int32_array, "logitsIndices");
    b.logits_indices = static_cast<const int32_t*>(logits_indices.data);
    b.num_logits = static_cast<int64_t>(logits_indices.length);
    const Napi::Value lora_slots = o.Get("loraSlots");
    if (!lora_slots.IsUndefined() && !lora_slots.IsNull()) {
      b.lora_slots = typed_data<int32_t>(env, lora_slots, napi_int32_array, "loraSlots", T);
    }

    // Logits go into the caller's buffer when it is given and large enough (an engine reuses one: a fresh
    // Float32Array of a decode step's 128 KB of logits measured ~50 us to allocate), else into a new array.
    const size_t count = static_cast<size_t>(b.num_logits) * static_cast<size_t>(m.spec().vocab_size);
    Napi::Float32Array logits;
    if (info.Length() > 1 && !info[1].IsUndefined()) {
      ArrayView out = typed_array(env, info[1], napi_float32_array, "out");
      if (out.length >= count) {
        Napi::TypedArray given = info[1].As<Napi::TypedArray>();
        logits = Napi::Float32Array::New(env, count, given.ArrayBuffer(), given.ByteOffset());
      }
    }
    if (logits.IsEmpty()) logits = Napi::Float32Array::New(env, count);
    try {
      m.forward(b, logits.Data());
    } catch (const InvalidInput& e) {
      throw Napi::RangeError::New(env, std::string("forward: ") + e.what());
    } catch (const std::bad_alloc&) {
      // The step's scratch could not grow. The model stays usable for steps no larger than those it ran before.
      throw allocation_failed(env, "forward: out of memory growing the step's scratch buffers for " +
                                       std::to_string(b.num_tokens) + " rows");
    }
    return logits;
  }

  Napi::Value Info(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Model& m = model(env);
    Napi::Object out = Napi::Object::New(env);
    out.Set("variant", variant_name(m.variant()));
    out.Set("threads", m.threads());
    out.Set("variants", variants_object(env, m.variant()));
    out.Set("hugePageBytes", static_cast<double>(m.huge_page_bytes()));
    out.Set("packedWeightBytes", static_cast<double>(m.packed_weight_bytes()));
    out.Set("releasedWeightBytes", static_cast<double>(m.released_weight_bytes()));
    return out;
  }

  Napi::Value SetProfiling(const Napi::CallbackInfo& info) {
    model(info.Env()).set_profiling(info[0].ToBoolean());
    return info.Env().Undefined();
  }

  // takeProfile() -> { [section]: { seconds, calls, cpuSeconds } } gathered since the last call
  Napi::Value TakeProfile(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const Profile p = model(env).take_profile();
    Napi::Object out = Napi::Object::New(env);
    for (const auto& [name, section] : p.sections) {
      Napi::Object o = Napi::Object::New(env);
      o.Set("seconds", section.seconds);
      o.Set("calls", static_cast<double>(section.calls));
      o.Set("cpuSeconds", section.cpu_seconds);
      out.Set(name, o);
    }
    return out;
  }

  // setLora(slot, adapter | null): adapter { scale, dtype?, layers: [{ wq?: { rank, a: Float32Array, b: Float32Array }, ...}] }
  // (src/model/lora.ts LoraWeights); the matrices are copied.
  Napi::Value SetLora(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Model& m = model(env);
    const int slot = static_cast<int>(integer(env, info[0], "slot"));
    std::unique_ptr<LoraAdapter> adapter;
    if (info.Length() > 1 && info[1].IsObject()) {
      Napi::Object o = info[1].As<Napi::Object>();
      adapter = std::make_unique<LoraAdapter>();
      adapter->scale = static_cast<float>(number(env, o.Get("scale"), "scale"));
      // dtype: how the matrices are stored ('f32' | 'bf16' | 'q8', default 'f32'; native/lora.h).
      const Napi::Value dtype = o.Get("dtype");
      if (!dtype.IsUndefined()) {
        const std::string name = dtype.IsString() ? dtype.As<Napi::String>().Utf8Value() : "";
        if (name == "f32") adapter->dtype = kLoraF32;
        else if (name == "bf16") adapter->dtype = kLoraBF16;
        else if (name == "q8") adapter->dtype = kLoraQ8;
        else throw Napi::TypeError::New(env, "adapter.dtype must be 'f32', 'bf16' or 'q8'");
      }
      if (!o.Get("layers").IsArray()) throw Napi::TypeError::New(env, "adapter.layers must be an array");
      Napi::Array layers = o.Get("layers").As<Napi::Array>();
      static const char* kNames[kLoraTargetCount] = {"wq", "wk", "wv", "wo", "wGate", "wUp", "wDown"};
      const ModelSpec& s = m.spec();
      const int64_t q_dim = s.num_heads * s.head_dim, kv_dim = s.num_kv_heads * s.head_dim;
      const int64_t in_of[kLoraTargetCount] = {s.dim, s.dim, s.dim, q_dim, s.dim, s.dim, s.ffn_dim};
      const int64_t out_of[kLoraTargetCount] = {q_dim, kv_dim, kv_dim, s.dim, s.ffn_dim, s.ffn_dim, s.dim};
      adapter->layers.resize(layers.Length());
      for (uint32_t l = 0; l < layers.Length(); ++l) {
        if (!layers.Get(l).IsObject()) continue;
        Napi::Object layer = layers.Get(l).As<Napi::Object>();
        for (int t = 0; t < kLoraTargetCount; ++t) {
          const Napi::Value value = layer.Get(kNames[t]);
          if (!value.IsObject()) continue;
          const std::string name = "layers[" + std::to_string(l) + "]." + kNames[t];
          Napi::Object mo = value.As<Napi::Object>();
          LoraMatrix& mat = adapter->layers[l][t];
          mat.rank = integer(env, mo.Get("rank"), name + ".rank", 1);
          mat.in = in_of[t];
          mat.out = out_of[t];
          ArrayView a = typed_array(env, mo.Get("a"), napi_float32_array, name + ".a");
          ArrayView bv = typed_array(env, mo.Get("b"), napi_float32_array, name + ".b");
          int64_t a_size = 0, b_size = 0;
          if (!mul_fits(mat.rank, mat.in, &a_size) || !mul_fits(mat.out, mat.rank, &b_size) ||
              a.length != static_cast<size_t>(a_size) || bv.length != static_cast<size_t>(b_size)) {
            throw Napi::RangeError::New(env, name + ": a must hold rank x " + std::to_string(mat.in) + " and b " +
                                                 std::to_string(mat.out) + " x rank floats");
          }
          const float* ap = static_cast<const float*>(a.data);
          const float* bp = static_cast<const float*>(bv.data);
          mat.a.assign(ap, ap + a.length);
          mat.b.assign(bp, bp + bv.length);
        }
      }
    }
    try {
      m.set_lora(slot, std::move(adapter));
    } catch (const InvalidInput& e) {
      throw Napi::RangeError::New(env, std::string("setLora: ") + e.what());
    } catch (const std::bad_alloc&) {
      throw allocation_failed(env, "setLora: out of memory copying the adapter");
    }
    return env.Undefined();
  }

  // argmax(row: Float32Array) -> the index of the row's first largest value, -1 for a NaN or nothing above -inf.
  // The sampler's greedy pick without a pass over the row in JavaScript; it reports the -1 rows itself.
  Napi::Value Argmax(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const Model& m = model(env);
    ArrayView row = typed_array(env, info[0], napi_float32_array, "row");
    return Napi::Number::New(env, static_cast<double>(m.argmax(static_cast<const float*>(row.data),
                                                              static_cast<int64_t>(row.length))));
  }

  // sampleWeigh(values, scale, max, floor, weights, blockTotals, binMass, binCount, last) -> total: the sampler's
  // weighing pass over a logits row with the model's kernels (addon_args.h, sample_weigh.h).
  Napi::Value SampleWeigh(const Napi::CallbackInfo& info) {
    return sample_weigh_call(info, 0, model(info.Env()).kernels());
  }

  // scaleRow(row, out, factor): out[i] = row[i] * factor as a Float32Array stores it (the sampler's copy of a row
  // at 1/temperature) with the model's kernels (addon_args.h).
  Napi::Value ScaleRow(const Napi::CallbackInfo& info) {
    return scale_row_call(info, 0, model(info.Env()).kernels());
  }

  // promptLogprobRows(logits: Float32Array, rows, targets: Int32Array, out: Float64Array, best: Int32Array, numBest,
  // rowIds?: Int32Array): the sampler's prompt-logprob pass over `rows` rows at once on the model's threads
  // (Model::prompt_logprob_rows: per row its argmax id, the weighing pass's total from that max, the count of values
  // above the target's, and its numBest best ids); with rowIds, entry r is of logits row rowIds[r].
  Napi::Value PromptLogprobRows(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Model& m = model(env);
    const int64_t rows = integer(env, info[1], "rows");
    const size_t vocab = static_cast<size_t>(m.spec().vocab_size);
    const int32_t* row_ids = nullptr;
    size_t logits_rows = static_cast<size_t>(rows);
    if (info.Length() > 6 && !info[6].IsUndefined()) {
      row_ids = typed_data<int32_t>(env, info[6], napi_int32_array, "rowIds", static_cast<size_t>(rows));
      logits_rows = 0;
      for (int64_t r = 0; r < rows; ++r) {
        if (row_ids[r] < 0) throw Napi::RangeError::New(env, "promptLogprobRows: rowIds[" + std::to_string(r) + "] is negative");
        logits_rows = std::max(logits_rows, static_cast<size_t>(row_ids[r]) + 1);
      }
    }
    const float* logits = typed_data<float>(env, info[0], napi_float32_array, "logits", logits_rows * vocab);
    const int32_t* targets = typed_data<int32_t>(env, info[2], napi_int32_array, "targets", static_cast<size_t>(rows));
    double* out = typed_data<double>(env, info[3], napi_float64_array, "out", 3 * static_cast<size_t>(rows));
    const int64_t num_best = integer(env, info[5], "numBest");
    if (num_best > m.spec().vocab_size) throw Napi::RangeError::New(env, "numBest must be at most the vocabulary size");
    int32_t* best = typed_data<int32_t>(env, info[4], napi_int32_array, "best", static_cast<size_t>(rows * num_best));
    try {
      m.prompt_logprob_rows(logits, rows, targets, out, best, num_best, row_ids);
    } catch (const InvalidInput& e) {
      throw Napi::RangeError::New(env, std::string("promptLogprobRows: ") + e.what());
    } catch (const std::bad_alloc&) {
      throw allocation_failed(env, "promptLogprobRows: out of memory for the weights scratch");
    }
    return env.Undefined();
  }

  // sampleRows(logits: Float32Array, rows: Int32Array, specs: Float64Array, out: Int32Array): the sampler's random
  // draws of the given logits rows at once on the model's threads (Model::sample_rows, addon_args.h).
  Napi::Value SampleRows(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Model& m = model(env);
    const SampleRowsArgs a = sample_rows_args(info, 0, m.spec().vocab_size);
    try {
      m.sample_rows(a.logits, a.count, a.rows, a.specs, a.out);
    } catch (const std::bad_alloc&) {
      throw allocation_failed(env, "sampleRows: out of memory for the draw scratch");
    }
    return env.Undefined();
  }

  // releaseKvPool() -> bytes of the pool given back to the system
  Napi::Value ReleaseKvPool(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), static_cast<double>(model(info.Env()).release_kv_pool()));
  }

  // memoryInfo() -> { activationBytes, workspaceBytes, loraBytes }: the per-step buffers the model holds now and
  // the LoRA adapters in its slots (model.h)
  Napi::Value MemoryInfo(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Model& m = model(env);
    Napi::Object out = Napi::Object::New(env);
    out.Set("activationBytes", static_cast<double>(m.activation_bytes()));
    out.Set("workspaceBytes", static_cast<double>(m.workspace_bytes()));
    out.Set("loraBytes", static_cast<double>(m.lora_bytes()));
    return out;
  }

  // An Error with code 'native_allocation_failed', so callers can tell running out of memory from other failures.
  static Napi::Error allocation_failed(const Napi::Env& env, const std::string& message) {
    Napi::Error error = Napi::Error::New(env, message);
    error.Value().Set("code", Napi::String::New(env, "native_allocation_failed"));
    return error;
  }

  // kvPoolResidentBytes() -> bytes of the pool resident in memory now
  Napi::Value KvPoolResidentBytes(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), static_cast<double>(model(info.Env()).kv_pool_resident_bytes()));
  }

  Napi::Value Dispose(const Napi::CallbackInfo& info) {
    model_.reset();
    keep_.clear();
    return info.Env().Undefined();
  }

  std::unique_ptr<Model> model_;
  std::vector<Napi::ObjectReference> keep_;  // weight arrays and the KV pool view: alive as long as the model
};

// ---------------------------------------------------------------------------------------------------------------
// bench.*

// memoryBandwidth(kind: 'read' | 'copy' | 'triad', bytesPerArray, repetitions, threads) -> best GB/s
Napi::Value BenchMemory(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const std::string kind = info[0].ToString().Utf8Value();
  const int64_t bytes = integer(env, info[1], "bytesPerArray", 4096);
  const int reps = static_cast<int>(integer(env, info[2], "repetitions", 1));
  const int threads = static_cast<int>(integer(env, info[3], "threads", 1));
  MemoryKernel k;
  if (kind == "read") k = MemoryKernel::Read;
  else if (kind == "copy") k = MemoryKernel::Copy;
  else if (kind == "triad") k = MemoryKernel::Triad;
  else throw Napi::TypeError::New(env, "kind must be 'read', 'copy' or 'triad'");
  ThreadPool pool(threads);
  return Napi::Number::New(env, memory_bandwidth_gbps(pool, k, static_cast<size_t>(bytes), reps));
}

// peakFlops(kind: 'f32' | 'int8' | 'bf16', threads, variant = best) -> GFLOP/s (int8: GOP/s, one multiply-add = 2
// ops; bf16: VDPBF16PS, 0 where the variant or CPU has none)
Napi::Value BenchPeak(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const std::string kind = info[0].ToString().Utf8Value();
  const int threads = static_cast<int>(integer(env, info[1], "threads", 1));
  const Variant variant = info[2].IsUndefined() ? best_supported_variant() : run_variant_arg(env, info[2]);
  if (kind != "f32" && kind != "int8" && kind != "bf16") {
    throw Napi::TypeError::New(env, "kind must be 'f32', 'int8' or 'bf16'");
  }
  ThreadPool pool(threads);
  if (kind == "bf16") return Napi::Number::New(env, peak_bf16_gflops(pool, variant));
  return Napi::Number::New(env, kind == "f32" ? peak_f32_gflops(pool, variant) : peak_int8_gops(pool, variant));
}

// threadCpuSeconds() -> the calling thread's CPU time in seconds (CLOCK_THREAD_CPUTIME_ID: exact to the
// nanosecond, where Linux's /proc schedstat counts only up to the last tick or switch)
Napi::Value BenchThreadCpu(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), thread_cpu_seconds());
}

// crashHandlerStatus() -> 'installed' or why not (a sanitizer build or runtime)
Napi::Value CrashHandlerStatus(const Napi::CallbackInfo& info) {
  return Napi::String::New(info.Env(), crash_handler_status());
}

// crashForTesting(kind, variant?): crashes the process on purpose, to test the crash handler's report. Refuses
// unless CONDUIT_NATIVE_CRASH_TEST=1 is set, so nothing can call it by accident.
Napi::Value CrashForTesting(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const char* allowed = std::getenv("CONDUIT_NATIVE_CRASH_TEST");
  if (!allowed || std::string(allowed) != "1") {
    throw Napi::Error::New(env, "crashForTesting needs CONDUIT_NATIVE_CRASH_TEST=1");
  }
  if (info.Length() > 1 && !info[1].IsUndefined()) run_variant_arg(env, info[1]);
  const std::string kind = info[0].ToString().Utf8Value();
  if (!crash_for_test(kind.c_str())) throw Napi::TypeError::New(env, "unknown crash kind " + kind);
  return env.Undefined();
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  // Once per process; each JavaScript thread that loads the addon (main, worker_threads) gets an alternate signal
  // stack for the handler, released when the thread exits.
  install_crash_handler();
  static thread_local SignalStackScope js_thread_signal_stack;
  exports.Set("crashHandlerStatus", Napi::Function::New(env, CrashHandlerStatus));
  exports.Set("crashForTesting", Napi::Function::New(env, CrashForTesting));
  exports.Set("cpuInfo", Napi::Function::New(env, CpuInfo));
  exports.Set("crc32c", Napi::Function::New(env, Crc32c));
  exports.Set("crc32cCopy", Napi::Function::New(env, Crc32cCopy));
  exports.Set("crc32cCopyRuns", Napi::Function::New(env, Crc32cCopyRuns));
  exports.Set("crc32cPath", Napi::Function::New(env, Crc32cPathInfo));
  exports.Set("shmMap", Napi::Function::New(env, ShmMap));
  exports.Set("shmUnmap", Napi::Function::New(env, ShmUnmap));
  exports.Set("kernelVariants", Napi::Function::New(env, KernelVariants));
  exports.Set("NativeModel", NativeModel::Define(env));
  exports.Set("ops", ops_object(env));
  Napi::Object bench = Napi::Object::New(env);
  bench.Set("memoryBandwidth", Napi::Function::New(env, BenchMemory));
  bench.Set("peakFlops", Napi::Function::New(env, BenchPeak));
  bench.Set("threadCpuSeconds", Napi::Function::New(env, BenchThreadCpu));
  exports.Set("bench", bench);
  return exports;
}

}  // namespace

NODE_API_MODULE(conduit_native, Init)
