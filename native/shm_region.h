// A file on the host's shared-memory file system mapped into this process, for the KV transfer's shared-memory
// link (src/cluster/kv-shm.ts): the prefill and the decode worker map the same file and copy block runs through it.
#pragma once

#include <napi.h>

namespace conduit::addon {

// shmMap(path: string, bytes: number, create: boolean): ArrayBuffer over a MAP_SHARED mapping of the file. create:
// the file must not exist; it is made with mode 0600, sized to bytes and (Linux) every page backed, so a full
// file system is an ENOSPC here rather than a SIGBUS at the first store to the mapping. Otherwise the file must exist and be
// exactly bytes long. The mapping lives until shmUnmap(buffer) or the buffer is collected. Throws an Error with
// the errno's text (and .code) when the file cannot be made, opened or mapped.
Napi::Value ShmMap(const Napi::CallbackInfo& info);
// shmUnmap(buffer): detaches the buffer (its views see 0 bytes from now on) and unmaps the region.
Napi::Value ShmUnmap(const Napi::CallbackInfo& info);

}  // namespace conduit::addon
