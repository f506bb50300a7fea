// The addon's ops.* entry points: each kernel through its driver with an explicit variant and thread count, and the
// software AMX model on its own. Only the kernel tests and benchmarks call them (test/kernels, benchmarks/); a served
// model runs through NativeModel.forward (addon.cc).
#include <napi.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "addon_args.h"
#include "addon_ops.h"
#include "amx_tile_model.h"
#include "crash_handler.h"
#include "memory.h"
#include "model.h"

using namespace conduit;
using namespace conduit::addon;

namespace {

// Pools and scratch for the ops entry points, one per thread count, created on first use.
struct OpsContext {
  std::unique_ptr<ThreadPool> pool;
  Workspace ws;
};
std::mutex ops_mutex;
std::map<int, std::unique_ptr<OpsContext>> ops_contexts;

OpsContext& ops_context(int threads) {
  auto& slot = ops_contexts[threads];
  if (!slot) {
    slot = std::make_unique<OpsContext>();
    slot->pool = std::make_unique<ThreadPool>(threads);
  }
  return *slot;
}

// ---------------------------------------------------------------------------------------------------------------
// ops.*: each kernel through its driver, with an explicit variant and thread count.

// The matmul kernel of a variant and type, or an error for types the variant cannot multiply.
const MatmulKernel& matmul_kernel(const Napi::Env& env, Variant v, int type) {
  const MatmulKernel& mk = kernel_table(v).matmul[type];
  if (!mk.tile) throw Napi::RangeError::New(env, std::string("no matmul kernel for ") + type_name(type));
  return mk;
}

// packedBytes(variant, type, k, n) -> bytes of the load-time packed layout of an [n x k] matrix, 0 if none
Napi::Value OpPackedBytes(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  const int type = weight_type_arg(env, info[1], "type");
  const int64_t k = integer(env, info[2], "k", 1), n = integer(env, info[3], "n", 1);
  const MatmulKernel& mk = matmul_kernel(env, v, type);
  return Napi::Number::New(env, mk.pack ? static_cast<double>(mk.packed_bytes(n, k)) : 0.0);
}

// pack(variant, type, w: Uint8Array, k, n) -> Uint8Array: the [n x k] matrix w in the variant's load-time packed
// layout, as a model packs it, in 64-byte aligned memory the addon owns (freed with the array).
Napi::Value OpPack(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  const int type = weight_type_arg(env, info[1], "type");
  const int64_t k = integer(env, info[3], "k", 1), n = integer(env, info[4], "n", 1);
  if (k % type_block_elements(type) != 0) {
    throw Napi::RangeError::New(env, "k = " + std::to_string(k) + " is not a multiple of the block size of " +
                                         type_name(type));
  }
  const MatmulKernel& mk = matmul_kernel(env, v, type);
  if (!mk.pack) {
    throw Napi::RangeError::New(env, std::string(variant_name(v)) + " has no packed layout for " + type_name(type));
  }
  const uint8_t* w = typed_data<uint8_t>(env, info[2], napi_uint8_array, "w", row_bytes(type, k) * n);
  const size_t bytes = mk.packed_bytes(n, k);
  constexpr size_t kHugePage = 2u << 20;
  std::unique_ptr<uint8_t, void (*)(void*)> out(
      static_cast<uint8_t*>(std::aligned_alloc(kHugePage, (bytes + kHugePage - 1) & ~(kHugePage - 1))), std::free);
  if (!out) throw Napi::Error::New(env, "out of memory packing the weights");
  advise_huge_pages(out.get(), bytes, false);  // as a model's packed weights are
  mk.pack(w, n, k, 0, packed_panel_count(n), out.get());
  Napi::ArrayBuffer buffer = Napi::ArrayBuffer::New(env, out.get(), bytes, [](Napi::Env, void* p) { std::free(p); });
  out.release();  // the array owns it now
  return Napi::Uint8Array::New(env, bytes, buffer, 0);
}

// guardedBytes(length) -> Uint8Array of `length` zero bytes whose last byte is followed by an inaccessible page: a
// kernel that reads past the end of such an array faults at once instead of reading a neighbour's bytes (tests).
Napi::Value OpGuardedBytes(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const int64_t length = integer(env, info[0], "length", 1);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t data_pages = (static_cast<size_t>(length) + page - 1) / page;
  const size_t mapped = (data_pages + 1) * page;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) throw Napi::Error::New(env, "guardedBytes: mmap failed");
  uint8_t* guard = static_cast<uint8_t*>(base) + data_pages * page;
  mprotect(guard, page, PROT_NONE);
  uint8_t* data = guard - length;
  struct Mapping { void* base; size_t bytes; };
  Napi::ArrayBuffer buffer = Napi::ArrayBuffer::New(
      env, data, static_cast<size_t>(length),
      [](Napi::Env, void*, Mapping* m) { munmap(m->base, m->bytes); delete m; }, new Mapping{base, mapped});
  return Napi::Uint8Array::New(env, static_cast<size_t>(length), buffer, 0);
}

// matmul(variant, type, w: Uint8Array, x: Float32Array, m, k, n, y: Float32Array, threads, packed = false)
// packed: w is the variant's load-time layout of the matrix (from pack), not ggml rows.
Napi::Value OpMatmul(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  const int type = weight_type_arg(env, info[1], "type");
  const int64_t m = integer(env, info[4], "m"), k = integer(env, info[5], "k", 1), n = integer(env, info[6], "n");
  if (k % type_block_elements(type) != 0) {
    throw Napi::RangeError::New(env, "k = " + std::to_string(k) + " is not a multiple of the block size of " +
                                         type_name(type));
  }
  const bool packed = info[9].ToBoolean();
  const MatmulKernel& mk = matmul_kernel(env, v, type);
  if (packed && !mk.pack) {
    throw Napi::RangeError::New(env, std::string(variant_name(v)) + " has no packed layout for " + type_name(type));
  }
  const uint8_t* w = typed_data<uint8_t>(env, info[2], napi_uint8_array, "w",
                                         packed ? mk.packed_bytes(n, k) : row_bytes(type, k) * n);
  if (packed && reinterpret_cast<uintptr_t>(w) % 64 != 0) {
    throw Napi::RangeError::New(env, "packed weights must be 64-byte aligned (use ops.pack)");
  }
  const float* x = typed_data<float>(env, info[3], napi_float32_array, "x", m * k);
  float* y = typed_data<float>(env, info[7], napi_float32_array, "y", m * n);
  const int threads = static_cast<int>(integer(env, info[8], "threads", 1));
  std::lock_guard<std::mutex> lock(ops_mutex);
  OpsContext& c = ops_context(threads);
  MatmulOutput out{w, type, n, y, n, packed};
  matmul(kernel_table(v), *c.pool, c.ws, x, m, k, &out, 1);
  return env.Undefined();
}

// lora(variant, dtype, adapters: [{ rank, a: Float32Array [rank x in], b: Float32Array [out x rank], scale }], in,
// out, x: Float32Array [rows x in], slots: Int32Array [rows] (-1: no adapter), y: Float32Array [rows x out], threads):
// y[r] += scale * B (A x[r]) through lora_apply with the adapters packed in dtype ('f32' | 'bf16' | 'q8').
Napi::Value OpLora(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  const std::string dtype_name = info[1].IsString() ? info[1].As<Napi::String>().Utf8Value() : "";
  const int dtype = dtype_name == "f32" ? kLoraF32 : dtype_name == "bf16" ? kLoraBF16 : dtype_name == "q8" ? kLoraQ8 : -1;
  if (dtype < 0) throw Napi::TypeError::New(env, "dtype must be 'f32', 'bf16' or 'q8'");
  if (!info[2].IsArray()) throw Napi::TypeError::New(env, "adapters must be an array");
  const int64_t in = integer(env, info[3], "in", 1), out = integer(env, info[4], "out", 1);
  Napi::Array list = info[2].As<Napi::Array>();
  LoraSet set;
  for (uint32_t i = 0; i < list.Length(); ++i) {
    if (!list.Get(i).IsObject()) throw Napi::TypeError::New(env, "adapters[" + std::to_string(i) + "] must be an object");
    Napi::Object o = list.Get(i).As<Napi::Object>();
    auto adapter = std::make_unique<LoraAdapter>();
    adapter->scale = static_cast<float>(number(env, o.Get("scale"), "scale"));
    adapter->dtype = dtype;
    adapter->layers.resize(1);
    LoraMatrix& m = adapter->layers[0][kLoraQ];
    m.rank = integer(env, o.Get("rank"), "rank", 1);
    m.in = in;
    m.out = out;
    int64_t a_size = 0, b_size = 0;
    if (!mul_fits(m.rank, in, &a_size) || !mul_fits(out, m.rank, &b_size)) throw Napi::RangeError::New(env, "rank x in or out is too large");
    const float* a = typed_data<float>(env, o.Get("a"), napi_float32_array, "a", a_size);
    const float* b = typed_data<float>(env, o.Get("b"), napi_float32_array, "b", b_size);
    m.a.assign(a, a + a_size);
    m.b.assign(b, b + b_size);
    set.set(static_cast<int>(i), std::move(adapter));
  }
  ArrayView slots_view = typed_array(env, info[6], napi_int32_array, "slots");
  const int64_t rows = static_cast<int64_t>(slots_view.length);
  const int32_t* slots = static_cast<const int32_t*>(slots_view.data);
  for (int64_t r = 0; r < rows; ++r) {
    if (slots[r] != -1 && !set.get(slots[r])) throw Napi::RangeError::New(env, "slots[" + std::to_string(r) + "] names no adapter");
  }
  const float* x = typed_data<float>(env, info[5], napi_float32_array, "x", rows * in);
  float* y = typed_data<float>(env, info[7], napi_float32_array, "y", rows * out);
  const int threads = static_cast<int>(integer(env, info[8], "threads", 1));
  std::lock_guard<std::mutex> lock(ops_mutex);
  OpsContext& c = ops_context(threads);
  LoraPlan plan;
  lora_apply(kernel_table(v), *c.pool, plan, set, slots, rows, 0, kLoraQ, x, in, y, out);
  return env.Undefined();
}

// embedding(variant, type, table: Uint8Array, dim, tokenIds: Int32Array, out: Float32Array)
Napi::Value OpEmbedding(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  const int type = weight_type_arg(env, info[1], "type");
  const int64_t dim = integer(env, info[3], "dim", 1);
  if (dim % type_block_elements(type) != 0) throw Napi::RangeError::New(env, "dim is not a multiple of the block size");
  ArrayView table = typed_array(env, info[2], napi_uint8_array, "table");
  ArrayView ids = typed_array(env, info[4], napi_int32_array, "tokenIds");
  float* out = typed_data<float>(env, info[5], napi_float32_array, "out", ids.length * dim);
  const size_t rb = row_bytes(type, dim);
  const int64_t rows = static_cast<int64_t>(table.length / rb);
  const int32_t* id = static_cast<const int32_t*>(ids.data);
  for (size_t i = 0; i < ids.length; ++i) {
    if (id[i] < 0 || id[i] >= rows) {
      throw Napi::RangeError::New(env, "tokenIds[" + std::to_string(i) + "] is outside the table's " +
                                           std::to_string(rows) + " rows");
    }
    kernel_table(v).dequantize_row[type](static_cast<const uint8_t*>(table.data) + id[i] * rb, out + i * dim, dim);
  }
  return env.Undefined();
}

// rmsnorm(variant, x, weight, rows, dim, eps, out)
Napi::Value OpRmsNorm(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  const int64_t rows = integer(env, info[3], "rows"), dim = integer(env, info[4], "dim", 1);
  const float* x = typed_data<float>(env, info[1], napi_float32_array, "x", rows * dim);
  const float* w = typed_data<float>(env, info[2], napi_float32_array, "weight", dim);
  const float eps = static_cast<float>(number(env, info[5], "eps"));
  float* out = typed_data<float>(env, info[6], napi_float32_array, "out", rows * dim);
  for (int64_t r = 0; r < rows; ++r) kernel_table(v).rmsnorm(x + r * dim, w, out + r * dim, dim, eps);
  return env.Undefined();
}

// argmax(variant, row) -> index of the row's first largest value; -1 for a NaN or nothing above -inf
Napi::Value OpArgmax(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  ArrayView row = typed_array(env, info[1], napi_float32_array, "row");
  return Napi::Number::New(env, static_cast<double>(kernel_table(v).argmax(static_cast<const float*>(row.data),
                                                                          static_cast<int64_t>(row.length))));
}

// sampleWeigh(variant, values, scale, max, floor, weights, blockTotals, binMass, binCount, last) -> total (addon_args.h)
Napi::Value OpSampleWeigh(const Napi::CallbackInfo& info) {
  const Variant v = run_variant_arg(info.Env(), info[0]);
  return sample_weigh_call(info, 1, kernel_table(v));
}

// sampleRows(variant, vocab, logits, rows, specs, out): the sampler's random draws of the given rows of `vocab`
// values (addon_args.h, sample_draw.h), one after another on this thread.
Napi::Value OpSampleRows(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  const int64_t vocab = integer(env, info[1], "vocab", 1);
  const SampleRowsArgs a = sample_rows_args(info, 2, vocab);
  sample::DrawScratch scratch;
  for (int64_t i = 0; i < a.count; ++i) {
    a.out[i] = static_cast<int32_t>(sample::draw_row(kernel_table(v), a.logits + a.rows[i] * vocab, vocab,
                                                     a.specs + i * sample::kDrawSpecWords, scratch));
  }
  return env.Undefined();
}

// scaleRow(variant, row, out, factor): out[i] = row[i] * factor as a Float32Array stores it (addon_args.h)
Napi::Value OpScaleRow(const Napi::CallbackInfo& info) {
  const Variant v = run_variant_arg(info.Env(), info[0]);
  return scale_row_call(info, 1, kernel_table(v));
}

// add(variant, acc, x): acc += x over acc.length elements
Napi::Value OpAdd(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  ArrayView acc = typed_array(env, info[1], napi_float32_array, "acc");
  const float* x = typed_data<float>(env, info[2], napi_float32_array, "x", acc.length);
  kernel_table(v).add(static_cast<float*>(acc.data), x, static_cast<int64_t>(acc.length));
  return env.Undefined();
}

// (variant, gate, up, out) over gate.length elements, through the kernel table entry `fn` (swiglu, geglu)
template <typename Fn>
Napi::Value gated_op(const Napi::CallbackInfo& info, Fn KernelTable::*fn) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  ArrayView gate = typed_array(env, info[1], napi_float32_array, "gate");
  const float* up = typed_data<float>(env, info[2], napi_float32_array, "up", gate.length);
  float* out = typed_data<float>(env, info[3], napi_float32_array, "out", gate.length);
  (kernel_table(v).*fn)(static_cast<const float*>(gate.data), up, out, static_cast<int64_t>(gate.length));
  return env.Undefined();
}

Napi::Value OpSwiglu(const Napi::CallbackInfo& info) { return gated_op(info, &KernelTable::swiglu); }
Napi::Value OpGeglu(const Napi::CallbackInfo& info) { return gated_op(info, &KernelTable::geglu); }

// softmax(variant, x, rows, n): each row of n in place
Napi::Value OpSoftmax(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  const int64_t rows = integer(env, info[2], "rows"), n = integer(env, info[3], "n", 1);
  float* x = typed_data<float>(env, info[1], napi_float32_array, "x", rows * n);
  for (int64_t r = 0; r < rows; ++r) kernel_table(v).softmax(x + r * n, n);
  return env.Undefined();
}

// rope(variant, x, positions, numHeads, headDim, ropeDim, neox, theta, scaling?): x [rows x numHeads*headDim]
Napi::Value OpRope(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  ArrayView positions = typed_array(env, info[2], napi_int32_array, "positions");
  RopeParams p;
  p.num_heads = static_cast<int>(integer(env, info[3], "numHeads", 1));
  p.head_dim = static_cast<int>(integer(env, info[4], "headDim", 1));
  p.rope_dim = static_cast<int>(integer(env, info[5], "ropeDim", 2));
  p.neox = info[6].ToBoolean();
  if (p.rope_dim % 2 != 0 || p.rope_dim > p.head_dim) {
    throw Napi::RangeError::New(env, "ropeDim must be even and <= headDim");
  }
  RopeConfig c;
  c.theta = number(env, info[7], "theta");
  c.rope_dim = p.rope_dim;
  read_rope_scaling(env, info[8], &c);
  if (c.scaling == RopeConfig::Scaling::LongRope && c.freq_factors.size() != static_cast<size_t>(c.rope_dim / 2)) {
    throw Napi::RangeError::New(env, "LongRoPE needs ropeDim / 2 factors");
  }
  const int64_t rows = static_cast<int64_t>(positions.length);
  float* x = typed_data<float>(env, info[1], napi_float32_array, "x", rows * p.num_heads * p.head_dim);
  std::lock_guard<std::mutex> lock(ops_mutex);
  OpsContext& ctx = ops_context(1);
  RopeTable table;
  table.compute(*ctx.pool, rope_inverse_frequencies(c), static_cast<const int32_t*>(positions.data), rows, c.mscale);
  apply_rope(kernel_table(v), *ctx.pool, table, p, x, rows);
  return env.Undefined();
}

struct PoolArg {
  uint8_t* data;
  int64_t num_layers, num_blocks, block_size, num_kv_heads, head_dim;
  bool f16;
  /** Bytes of one layer's K (or V) region; 0 when the layout's product does not fit (pool_arg refuses it). */
  size_t region_bytes() const {
    int64_t slots = 0, width = 0, elements = 0;
    if (!mul_fits(num_blocks, block_size, &slots) || !mul_fits(num_kv_heads, head_dim, &width) ||
        !mul_fits(slots, width, &elements) || elements > (INT64_MAX / 4) / (2 * num_layers)) return 0;
    return static_cast<size_t>(elements) * (f16 ? 2 : 4);
  }
};

// The pool and its layout { numLayers, numBlocks, blockSize, numKvHeads, headDim, dtype }.
PoolArg pool_arg(const Napi::Env& env, const Napi::Value& pool, const Napi::Value& layout_value) {
  if (!layout_value.IsObject()) throw Napi::TypeError::New(env, "layout must be an object");
  Napi::Object layout = layout_value.As<Napi::Object>();
  PoolArg p;
  p.num_layers = integer(env, layout.Get("numLayers"), "numLayers", 1);
  p.num_blocks = integer(env, layout.Get("numBlocks"), "numBlocks", 1);
  p.block_size = integer(env, layout.Get("blockSize"), "blockSize", 1);
  p.num_kv_heads = integer(env, layout.Get("numKvHeads"), "numKvHeads", 1);
  p.head_dim = integer(env, layout.Get("headDim"), "headDim", 1);
  p.f16 = layout.Get("dtype").ToString().Utf8Value() == "f16";
  if (p.region_bytes() == 0) throw Napi::RangeError::New(env, "the layout's size (numBlocks x blockSize x numKvHeads x headDim) is too large");
  p.data = typed_data<uint8_t>(env, pool, napi_uint8_array, "pool", 2 * p.num_layers * p.region_bytes());
  return p;
}

// kvWrite(variant, k, v, slots, pool, layout, layer)
Napi::Value OpKvWrite(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  PoolArg p = pool_arg(env, info[4], info[5]);
  const int64_t layer = integer(env, info[6], "layer");
  if (layer >= p.num_layers) throw Napi::RangeError::New(env, "layer is outside the pool");
  ArrayView slots = typed_array(env, info[3], napi_int32_array, "slots");
  const int64_t rows = static_cast<int64_t>(slots.length), row_elems = p.num_kv_heads * p.head_dim;
  const float* k = typed_data<float>(env, info[1], napi_float32_array, "k", rows * row_elems);
  const float* vv = typed_data<float>(env, info[2], napi_float32_array, "v", rows * row_elems);
  const int32_t* s = static_cast<const int32_t*>(slots.data);
  for (int64_t i = 0; i < rows; ++i) {
    if (s[i] < 0 || s[i] >= p.num_blocks * p.block_size) throw Napi::RangeError::New(env, "slot outside the pool");
  }
  kv_write(kernel_table(v), k, vv, rows, row_elems, s, p.data + 2 * layer * p.region_bytes(),
           p.data + (2 * layer + 1) * p.region_bytes(), p.f16);
  return env.Undefined();
}

// attention(variant, q, out, pool, layout, layer, queryStartLoc, seqLens, blockTables, maxBlocksPerSeq, numHeads,
//           threads, window?)
Napi::Value OpAttention(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const Variant v = run_variant_arg(env, info[0]);
  PoolArg p = pool_arg(env, info[3], info[4]);
  const int64_t layer = integer(env, info[5], "layer");
  if (layer >= p.num_layers) throw Napi::RangeError::New(env, "layer is outside the pool");
  ArrayView qsl = typed_array(env, info[6], napi_int32_array, "queryStartLoc");
  if (qsl.length < 1) throw Napi::RangeError::New(env, "queryStartLoc needs numSeqs + 1 entries");
  const int num_seqs = static_cast<int>(qsl.length - 1);
  const int max_blocks = static_cast<int>(integer(env, info[9], "maxBlocksPerSeq"));
  const int64_t num_heads = integer(env, info[10], "numHeads", 1);
  const int threads = static_cast<int>(integer(env, info[11], "threads", 1));
  const int32_t* q_start = static_cast<const int32_t*>(qsl.data);
  const int32_t* seq_lens = typed_data<int32_t>(env, info[7], napi_int32_array, "seqLens", num_seqs);
  const int32_t* tables = typed_data<int32_t>(env, info[8], napi_int32_array, "blockTables",
                                              static_cast<size_t>(num_seqs) * max_blocks);
  if (num_heads % p.num_kv_heads != 0) throw Napi::RangeError::New(env, "numHeads is not a multiple of numKvHeads");
  const int64_t tokens = q_start[num_seqs];
  if (q_start[0] != 0) throw Napi::RangeError::New(env, "queryStartLoc must start at 0");
  for (int s = 0; s < num_seqs; ++s) {
    const int rows = q_start[s + 1] - q_start[s];
    if (rows < 0 || seq_lens[s] < rows || seq_lens[s] > static_cast<int64_t>(max_blocks) * p.block_size) {
      throw Napi::RangeError::New(env, "sequence " + std::to_string(s) + " has inconsistent lengths");
    }
    for (int64_t b = 0; b < div_ceil(seq_lens[s], p.block_size); ++b) {
      const int32_t id = tables[static_cast<int64_t>(s) * max_blocks + b];
      if (id < 0 || id >= p.num_blocks) throw Napi::RangeError::New(env, "block table entry outside the pool");
    }
  }
  const int64_t width = num_heads * p.head_dim;
  AttentionArgs a;
  a.q = typed_data<float>(env, info[1], napi_float32_array, "q", tokens * width);
  a.out = typed_data<float>(env, info[2], napi_float32_array, "out", tokens * width);
  a.k_cache = p.data + 2 * layer * p.region_bytes();
  a.v_cache = p.data + (2 * layer + 1) * p.region_bytes();
  a.kv_f16 = p.f16;
  a.num_heads = static_cast<int>(num_heads);
  a.num_kv_heads = static_cast<int>(p.num_kv_heads);
  a.head_dim = static_cast<int>(p.head_dim);
  a.block_size = static_cast<int>(p.block_size);
  a.query_start_loc = q_start;
  a.seq_lens = seq_lens;
  a.block_tables = tables;
  a.max_blocks_per_seq = max_blocks;
  a.scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  a.window = info[12].IsUndefined() ? 0 : static_cast<int>(integer(env, info[12], "window", 0));
  std::lock_guard<std::mutex> lock(ops_mutex);
  OpsContext& c = ops_context(threads);
  attention(kernel_table(v), *c.pool, c.ws, a, num_seqs);
  return env.Undefined();
}

// amxModel(program): runs tile instructions on a fresh software AMX model (the one the amx-model kernels use), so
// tests can check its semantics on values they work out themselves. Each entry is one of
//   { op: 'ldtilecfg', config: Uint8Array(64) }            { op: 'tilezero', tile }
//   { op: 'tileloadd' | 'tilestored', tile, memory: Uint8Array, offset, stride }
//   { op: 'tdpbsud', dst, src1, src2 }                     { op: 'tilerelease' }
// A fault the hardware would raise is thrown as an Error "<INSTRUCTION>: #GP|#UD (<why>)". Tile rows must lie
// inside `memory` (where the hardware would take a page fault or silently touch other data, this refuses).
Napi::Value OpAmxModel(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsArray()) throw Napi::TypeError::New(env, "program must be an array of instructions");
  Napi::Array program = info[0].As<Napi::Array>();
  auto model = std::make_unique<AmxTileModel>();
  for (uint32_t i = 0; i < program.Length(); ++i) {
    const std::string at = "program[" + std::to_string(i) + "]";
    if (!program.Get(i).IsObject()) throw Napi::TypeError::New(env, at + " must be an object");
    Napi::Object step = program.Get(i).As<Napi::Object>();
    const std::string op = step.Get("op").ToString().Utf8Value();
    auto tile = [&](const char* key) { return static_cast<int>(integer(env, step.Get(key), at + "." + key)); };
    try {
      if (op == "ldtilecfg") {
        model->ldtilecfg(typed_data<uint8_t>(env, step.Get("config"), napi_uint8_array, at + ".config", 64));
      } else if (op == "tilezero") {
        model->tilezero(tile("tile"));
      } else if (op == "tdpbsud") {
        model->tdpbsud(tile("dst"), tile("src1"), tile("src2"));
      } else if (op == "tilerelease") {
        model->tilerelease();
      } else if (op == "tileloadd" || op == "tilestored") {
        const int t = tile("tile");
        ArrayView memory = typed_array(env, step.Get("memory"), napi_uint8_array, at + ".memory");
        const int64_t offset = integer(env, step.Get("offset"), at + ".offset");
        const int64_t stride = integer(env, step.Get("stride"), at + ".stride");
        const int rows = model->rows(t), colsb = model->colsb(t);
        // An unconfigured tile faults in the model before touching memory.
        if (rows > 0 && offset + (rows - 1) * stride + colsb > static_cast<int64_t>(memory.length)) {
          throw Napi::RangeError::New(env, at + ": the tile's rows reach past the end of memory");
        }
        uint8_t* base = static_cast<uint8_t*>(memory.data) + offset;
        if (op == "tileloadd") {
          model->tileloadd(t, base, stride);
        } else {
          model->tilestored(t, base, stride);
        }
      } else {
        throw Napi::TypeError::New(env, at + ".op '" + op + "' is not a modelled instruction");
      }
    } catch (const AmxFault& fault) {
      throw Napi::Error::New(env, fault.what());
    }
  }
  return env.Undefined();
}

}  // namespace

namespace conduit {
namespace addon {

Napi::Object ops_object(Napi::Env env) {
  Napi::Object ops = Napi::Object::New(env);
  ops.Set("matmul", Napi::Function::New(env, OpMatmul));
  ops.Set("packedBytes", Napi::Function::New(env, OpPackedBytes));
  ops.Set("pack", Napi::Function::New(env, OpPack));
  ops.Set("guardedBytes", Napi::Function::New(env, OpGuardedBytes));
  ops.Set("embedding", Napi::Function::New(env, OpEmbedding));
  ops.Set("lora", Napi::Function::New(env, OpLora));
  ops.Set("rmsnorm", Napi::Function::New(env, OpRmsNorm));
  ops.Set("add", Napi::Function::New(env, OpAdd));
  ops.Set("argmax", Napi::Function::New(env, OpArgmax));
  ops.Set("sampleWeigh", Napi::Function::New(env, OpSampleWeigh));
  ops.Set("sampleRows", Napi::Function::New(env, OpSampleRows));
  ops.Set("scaleRow", Napi::Function::New(env, OpScaleRow));
  ops.Set("swiglu", Napi::Function::New(env, OpSwiglu));
  ops.Set("geglu", Napi::Function::New(env, OpGeglu));
  ops.Set("softmax", Napi::Function::New(env, OpSoftmax));
  ops.Set("rope", Napi::Function::New(env, OpRope));
  ops.Set("kvWrite", Napi::Function::New(env, OpKvWrite));
  ops.Set("attention", Napi::Function::New(env, OpAttention));
  ops.Set("amxModel", Napi::Function::New(env, OpAmxModel));
  return ops;
}

}  // namespace addon
}  // namespace conduit
