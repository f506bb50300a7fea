{
  "variables": {"sanitize%": ""},
  "targets": [
    {
      "target_name": "conduit_native",
      "sources": [
        "native/addon.cc",
        "native/addon_ops.cc",
        "native/bench.cc",
        "native/checksum.cc",
        "native/compute.cc",
        "native/cpu.cc",
        "native/crash_handler.cc",
        "native/memory.cc",
        "native/model.cc",
        "native/lora.cc",
        "native/moe.cc",
        "native/sample_draw.cc",
        "native/shm_region.cc",
        "native/thread_pool.cc",
        "native/ops_generic.cc",
        "native/matmul_generic.cc",
        "native/attention_generic.cc",
        "native/amx_tile_model.cc"
      ],
      "conditions": [
        ["target_arch=='x64' or target_arch=='ia32'", {
          "sources": [
            "native/ops_avx2.cc",
            "native/ops_avx512.cc",
            "native/matmul_avx2.cc",
            "native/matmul_avx512.cc",
            "native/matmul_avx512_bf16.cc",
            "native/matmul_amx.cc",
            "native/matmul_amx_model.cc",
            "native/attention_avx2.cc",
            "native/attention_avx512.cc"
          ]
        }],
        ["sanitize=='address'", {
          "cflags_cc": ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined"],
          "ldflags": ["-fsanitize=address,undefined"]
        }],
        ["sanitize=='thread'", {
          "cflags_cc": ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=thread"],
          "ldflags": ["-fsanitize=thread"]
        }]
      ],
      "include_dirs": ["<!(node -p \"require('node-addon-api').include_dir\")"],
      "defines": ["NAPI_VERSION=8", "NAPI_CPP_EXCEPTIONS", "NODE_API_SWALLOW_UNTHROWABLE_EXCEPTIONS"],
      "cflags!": ["-fno-exceptions"],
      "cflags_cc!": ["-fno-exceptions", "-fno-rtti", "-std=gnu++17", "-std=gnu++20"],
      "cflags_cc": ["-std=c++17", "-O3", "-fexceptions", "-Wall", "-Wextra", "-Wno-uninitialized",
                    "-Wno-unused-parameter"],
      "xcode_settings": {"GCC_ENABLE_CPP_EXCEPTIONS": "YES", "CLANG_CXX_LANGUAGE_STANDARD": "c++17"}
    }
  ]
}
