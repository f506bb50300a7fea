// shmMap / shmUnmap (shm_region.h). POSIX only; elsewhere both throw and the transfer uses TCP.
#include "shm_region.h"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define CONDUIT_SHM_MAP 1
#else
#define CONDUIT_SHM_MAP 0
#endif

namespace conduit::addon {

#if CONDUIT_SHM_MAP
namespace {

struct Mapping {
  void* data;
  size_t bytes;
};

void unmap(Napi::Env /*env*/, void* /*data*/, Mapping* mapping) {
  munmap(mapping->data, mapping->bytes);
  delete mapping;
}

Napi::Error errno_error(Napi::Env env, const std::string& what, int error) {
  Napi::Error e = Napi::Error::New(env, what + ": " + std::strerror(error));
  const char* code = error == ENOENT ? "ENOENT" : error == EEXIST ? "EEXIST" : error == ENOSPC ? "ENOSPC"
                   : error == ENOMEM ? "ENOMEM" : error == EACCES ? "EACCES" : "EIO";
  e.Set("code", Napi::String::New(env, code));
  return e;
}

}  // namespace
#endif

Napi::Value ShmMap(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 3 || !info[0].IsString() || !info[1].IsNumber()) {
    throw Napi::TypeError::New(env, "shmMap(path, bytes, create)");
  }
  const std::string path = info[0].As<Napi::String>().Utf8Value();
  const double requested = info[1].As<Napi::Number>().DoubleValue();
  if (!(requested >= 4096) || requested > 1024.0 * 1024 * 1024 || requested != static_cast<double>(static_cast<int64_t>(requested))) {
    throw Napi::RangeError::New(env, "bytes must be an integer from 4096 to 1 GiB");
  }
  const size_t bytes = static_cast<size_t>(requested);
  const bool create = info[2].ToBoolean().Value();
#if CONDUIT_SHM_MAP
  const int fd = create ? open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600) : open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw errno_error(env, "cannot open " + path, errno);
  if (create) {
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int error = errno;
      close(fd);
      unlink(path.c_str());
      throw errno_error(env, "cannot size " + path, error);
    }
#if defined(__linux__)
    // ftruncate leaves a sparse file: on a full tmpfs (a container's /dev/shm is 64 MB by default) the first store
    // to a page that was never backed would kill the process with SIGBUS. Backing every page now turns that into
    // ENOSPC here, and the caller falls back to TCP.
    if (const int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
      close(fd);
      unlink(path.c_str());
      throw errno_error(env, "cannot back " + path + " with " + std::to_string(bytes) + " bytes", error);
    }
#endif
  } else {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) != bytes) {
      close(fd);
      throw Napi::Error::New(env, path + " is not a region of " + std::to_string(bytes) + " bytes");
    }
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);  // the mapping keeps the file
  if (data == MAP_FAILED) {
    if (create) unlink(path.c_str());
    throw errno_error(env, "cannot map " + path, error);
  }
  auto* mapping = new Mapping{data, bytes};
  return Napi::ArrayBuffer::New(env, data, bytes, unmap, mapping);
#else
  (void)bytes;
  (void)create;
  throw Napi::Error::New(env, "shared-memory regions are not supported on this platform");
#endif
}

Napi::Value ShmUnmap(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsArrayBuffer()) throw Napi::TypeError::New(env, "shmUnmap(buffer)");
  Napi::ArrayBuffer buffer = info[0].As<Napi::ArrayBuffer>();
  // Detaching drops the backing store: its finalizer (unmap) runs once nothing refers to it.
  if (!buffer.IsDetached()) buffer.Detach();
  return env.Undefined();
}

}  // namespace conduit::addon
