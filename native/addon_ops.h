// ops.*: one entry per kernel with an explicit variant, for the kernel tests and benchmarks (addon_ops.cc).
#pragma once

#include <napi.h>

namespace conduit {
namespace addon {

Napi::Object ops_object(Napi::Env env);

}  // namespace addon
}  // namespace conduit
