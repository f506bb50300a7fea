// Argument conversion for the addon's entry points (addon.cc, addon_ops.cc): typed arrays, numbers, variants and
// ggml types from JavaScript values, each refused with a TypeError/RangeError that names the argument.
#pragma once

#include <napi.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "compute.h"
#include "cpu.h"
#include "crash_handler.h"
#include "kernels.h"
#include "sample_draw.h"
#include "sample_weigh.h"

namespace conduit {
namespace addon {


struct ArrayView {
  void* data = nullptr;
  size_t length = 0;  // elements
  napi_typedarray_type type = napi_uint8_array;
};

inline const char* typed_array_name(napi_typedarray_type t) {
  switch (t) {
    case napi_uint8_array: return "Uint8Array";
    case napi_int32_array: return "Int32Array";
    case napi_float32_array: return "Float32Array";
    case napi_float64_array: return "Float64Array";
    default: return "typed array";
  }
}

// Works for views over ArrayBuffer and SharedArrayBuffer alike (napi_get_typedarray_info gives the data pointer).
inline ArrayView typed_array(const Napi::Env& env, const Napi::Value& value, napi_typedarray_type expected,
                      const std::string& name) {
  bool is_typed = false;
  napi_is_typedarray(env, value, &is_typed);
  ArrayView view;
  if (is_typed) {
    napi_value buffer;
    size_t offset;
    napi_get_typedarray_info(env, value, &view.type, &view.length, &view.data, &buffer, &offset);
  }
  if (!is_typed || view.type != expected) {
    throw Napi::TypeError::New(env, name + " must be a " + typed_array_name(expected));
  }
  return view;
}

template <typename T>
T* typed_data(const Napi::Env& env, const Napi::Value& value, napi_typedarray_type expected, const std::string& name,
              size_t min_length) {
  ArrayView v = typed_array(env, value, expected, name);
  if (v.length < min_length) {
    throw Napi::RangeError::New(env, name + " has " + std::to_string(v.length) + " elements, needs " +
                                         std::to_string(min_length));
  }
  return static_cast<T*>(v.data);
}

inline int64_t integer(const Napi::Env& env, const Napi::Value& value, const std::string& name, int64_t min = 0) {
  if (!value.IsNumber()) throw Napi::TypeError::New(env, name + " must be a number");
  const double d = value.As<Napi::Number>().DoubleValue();
  if (d != static_cast<double>(static_cast<int64_t>(d)) || d < static_cast<double>(min)) {
    throw Napi::RangeError::New(env, name + " must be an integer >= " + std::to_string(min));
  }
  return static_cast<int64_t>(d);
}

inline double number(const Napi::Env& env, const Napi::Value& value, const std::string& name) {
  if (!value.IsNumber()) throw Napi::TypeError::New(env, name + " must be a number");
  return value.As<Napi::Number>().DoubleValue();
}

// sampleWeigh's arguments from info[first] on: (values: Float32Array, scale, max, floor, weights: Float64Array,
// blockTotals: Float64Array | null, binMass: Float64Array | null, binCount: Int32Array | null, last: Int32Array);
// runs the table's sample_weigh, puts the last id with a weight into last[0] and returns the total.
inline Napi::Value sample_weigh_call(const Napi::CallbackInfo& info, size_t first, const KernelTable& table) {
  Napi::Env env = info.Env();
  ArrayView values = typed_array(env, info[first], napi_float32_array, "values");
  const size_t n = values.length;
  const double scale = number(env, info[first + 1], "scale");
  if (!(scale > 0.0)) throw Napi::RangeError::New(env, "scale must be above 0");
  const double max = number(env, info[first + 2], "max");
  const double floor = number(env, info[first + 3], "floor");
  double* weights = typed_data<double>(env, info[first + 4], napi_float64_array, "weights", n);
  double* block_totals = info[first + 5].IsNull() ? nullptr
      : typed_data<double>(env, info[first + 5], napi_float64_array, "blockTotals",
                          (n + sample::kWeighBlock - 1) / sample::kWeighBlock);
  const bool bins = !info[first + 6].IsNull() || !info[first + 7].IsNull();
  double* bin_mass = bins ? typed_data<double>(env, info[first + 6], napi_float64_array, "binMass", sample::kMassBins)
                          : nullptr;
  int32_t* bin_count = bins ? typed_data<int32_t>(env, info[first + 7], napi_int32_array, "binCount", sample::kMassBins)
                           : nullptr;
  int32_t* last = typed_data<int32_t>(env, info[first + 8], napi_int32_array, "last", 1);
  int64_t last_id = 0;
  const double total = table.sample_weigh(static_cast<const float*>(values.data), static_cast<int64_t>(n), scale, max,
                                          floor, weights, block_totals, bin_mass, bin_count, &last_id);
  last[0] = static_cast<int32_t>(last_id);
  return Napi::Number::New(env, total);
}

// scaleRow's arguments from info[first] on: (row: Float32Array, out: Float32Array, at least as long, factor); runs the
// table's scale_row over the row's length (out may be the row itself).
inline Napi::Value scale_row_call(const Napi::CallbackInfo& info, size_t first, const KernelTable& table) {
  Napi::Env env = info.Env();
  ArrayView row = typed_array(env, info[first], napi_float32_array, "row");
  float* out = typed_data<float>(env, info[first + 1], napi_float32_array, "out", row.length);
  const double factor = number(env, info[first + 2], "factor");
  table.scale_row(static_cast<const float*>(row.data), out, static_cast<int64_t>(row.length), factor);
  return env.Undefined();
}

// sampleRows' arguments from info[first] on: (logits: Float32Array of whole rows of `vocab`, rows: Int32Array of
// row indices, specs: Float64Array of sample::kDrawSpecWords per entry, out: Int32Array, one per entry); checked.
struct SampleRowsArgs {
  const float* logits;
  int64_t count;
  const int32_t* rows;
  const double* specs;
  int32_t* out;
};

inline SampleRowsArgs sample_rows_args(const Napi::CallbackInfo& info, size_t first, int64_t vocab) {
  Napi::Env env = info.Env();
  ArrayView logits = typed_array(env, info[first], napi_float32_array, "logits");
  if (vocab <= 0 || logits.length % static_cast<size_t>(vocab) != 0) {
    throw Napi::RangeError::New(env, "logits must hold whole rows of " + std::to_string(vocab) + " values");
  }
  const int64_t num_rows = static_cast<int64_t>(logits.length) / vocab;
  ArrayView rows = typed_array(env, info[first + 1], napi_int32_array, "rows");
  const size_t count = rows.length;
  const int32_t* row_ids = static_cast<const int32_t*>(rows.data);
  for (size_t i = 0; i < count; ++i) {
    if (row_ids[i] < 0 || row_ids[i] >= num_rows) {
      throw Napi::RangeError::New(env, "rows[" + std::to_string(i) + "] = " + std::to_string(row_ids[i]) +
                                           " is not a row of the " + std::to_string(num_rows) + " given");
    }
  }
  const double* specs = typed_data<double>(env, info[first + 2], napi_float64_array, "specs", count * sample::kDrawSpecWords);
  for (size_t i = 0; i < count; ++i) {
    const double* spec = specs + i * sample::kDrawSpecWords;
    if (!(spec[0] >= 0.0) || !(spec[1] <= 0.0) || !(spec[2] > 0.0) || !(spec[3] >= 0.0 && spec[3] < 1.0) ||
        !(spec[4] >= 0.0 && spec[4] < static_cast<double>(vocab)) || spec[4] != static_cast<double>(static_cast<int64_t>(spec[4]))) {
      throw Napi::RangeError::New(env, "specs[" + std::to_string(i) + "] must be a scale of 0 (greedy) or above, log min_p <= 0, " +
                                           "top_p above 0, a uniform in [0, 1) and a whole top_k below the vocabulary");
    }
  }
  int32_t* out = typed_data<int32_t>(env, info[first + 3], napi_int32_array, "out", count);
  return {static_cast<const float*>(logits.data), static_cast<int64_t>(count), row_ids, specs, out};
}

inline Variant variant_arg(const Napi::Env& env, const Napi::Value& value) {
  Variant v;
  if (!value.IsString() || !parse_variant(value.As<Napi::String>().Utf8Value().c_str(), &v)) {
    throw Napi::TypeError::New(env, "variant must be 'generic', 'avx2', 'avx512', 'amx' or 'amx-model'");
  }
  if (!variant_supported(v)) {
    throw Napi::Error::New(env, std::string("kernel variant ") + variant_name(v) + " is not supported by this CPU" +
                                    " (best: " + variant_name(best_supported_variant()) +
                                    (v == Variant::AmxModel ? "; amx-model needs avx512)" : ")"));
  }
  return v;
}

// variant_arg for an entry point that runs the variant's kernels: the crash handler's message names it.
inline Variant run_variant_arg(const Napi::Env& env, const Napi::Value& value) {
  const Variant v = variant_arg(env, value);
  note_kernel_variant(variant_name(v));
  return v;
}

inline int weight_type_arg(const Napi::Env& env, const Napi::Value& value, const std::string& name) {
  const int64_t type = integer(env, value, name);
  if (!is_supported_type(static_cast<int>(type))) {
    throw Napi::TypeError::New(env, name + ": ggml type " + std::to_string(type) + " is not supported");
  }
  return static_cast<int>(type);
}

inline Napi::Object variants_object(const Napi::Env& env, Variant v) {
  Napi::Object out = Napi::Object::New(env);
  for (const auto& [kind, name] : kernel_table(v).names) out.Set(kind, name);
  return out;
}

// ropeScaling as in ModelConfig: undefined, { type: 'linear', factor } or { type: 'llama3', factor, lowFreqFactor,
// highFreqFactor, originalContextLength }.
inline void read_rope_scaling(const Napi::Env& env, const Napi::Value& value, RopeConfig* rope) {
  if (value.IsUndefined() || value.IsNull()) return;
  if (!value.IsObject()) throw Napi::TypeError::New(env, "ropeScaling must be an object");
  Napi::Object o = value.As<Napi::Object>();
  const std::string type = o.Get("type").ToString().Utf8Value();
  if (type == "longrope") {
    rope->scaling = RopeConfig::Scaling::LongRope;
    if (!o.Get("factors").IsArray()) throw Napi::TypeError::New(env, "ropeScaling.factors must be an array");
    Napi::Array factors = o.Get("factors").As<Napi::Array>();
    rope->freq_factors.clear();
    for (uint32_t i = 0; i < factors.Length(); ++i) {
      const double f = number(env, factors.Get(i), "ropeScaling.factors[]");
      if (!(f > 0)) throw Napi::RangeError::New(env, "ropeScaling.factors must be positive");
      rope->freq_factors.push_back(f);
    }
    rope->mscale = number(env, o.Get("attentionFactor"), "ropeScaling.attentionFactor");
    return;
  }
  rope->factor = number(env, o.Get("factor"), "ropeScaling.factor");
  if (type == "linear") {
    rope->scaling = RopeConfig::Scaling::Linear;
  } else if (type == "llama3") {
    rope->scaling = RopeConfig::Scaling::Llama3;
    rope->low_freq_factor = number(env, o.Get("lowFreqFactor"), "ropeScaling.lowFreqFactor");
    rope->high_freq_factor = number(env, o.Get("highFreqFactor"), "ropeScaling.highFreqFactor");
    rope->original_context = number(env, o.Get("originalContextLength"), "ropeScaling.originalContextLength");
  } else {
    throw Napi::TypeError::New(env, "ropeScaling.type must be 'linear', 'llama3' or 'longrope', got '" + type + "'");
  }
}

}  // namespace addon
}  // namespace conduit
