#include "crash_handler.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "thread_pool.h"

namespace conduit {

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
constexpr size_t kSignalStackBytes = 64 * 1024;  // the message and backtrace() need a few KiB; SIGSTKSZ is 8 KiB
constexpr int kBacktraceFrames = 32;

std::atomic<bool> g_installed{false};
const char* g_status = "not installed";
std::atomic<const char*> g_variant{"none yet"};
std::atomic<bool> g_reporting{false};

// Node (through V8) handles SIGSEGV for WebAssembly bounds checks: an out-of-bounds access in wasm code faults and
// V8's handler turns it into a JavaScript exception. Replacing the handler must keep that working, so a SIGSEGV
// is first offered to V8's trap handler (async-signal-safe by design) and reported only when it is not a wasm
// trap. Looked up at install time (dlsym is not async-signal-safe); absent outside Node.
using WasmTrapHandler = bool (*)(int, siginfo_t*, void*);
WasmTrapHandler g_wasm_trap = nullptr;

// ---------------------------------------------------------------------------------------------------------------
// Async-signal-safe formatting: a fixed buffer, write(2) only.

struct Message {
  char buf[1024];
  size_t len = 0;
  void add(const char* s) {
    while (*s && len < sizeof(buf)) buf[len++] = *s++;
  }
  void add_number(uint64_t v, int base = 10) {
    char digits[24];
    int n = 0;
    do {
      const int d = static_cast<int>(v % base);
      digits[n++] = static_cast<char>(d < 10 ? '0' + d : 'a' + d - 10);
      v /= base;
    } while (v != 0 && n < 24);
    if (base == 16) add("0x");
    while (n > 0 && len < sizeof(buf)) buf[len++] = digits[--n];
  }
  void flush() {
    size_t off = 0;
    while (off < len) {
      const ssize_t w = write(STDERR_FILENO, buf + off, len - off);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    len = 0;
  }
};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGILL: return "SIGILL";
    case SIGFPE: return "SIGFPE";
    case SIGABRT: return "SIGABRT";
    default: return "signal";
  }
}

const char* signal_cause(int sig, int code) {
  if (code == SI_USER || code == SI_TKILL) return "sent by kill/raise";
  switch (sig) {
    case SIGSEGV:
      return code == SEGV_MAPERR ? "invalid memory reference: address not mapped (or a stack overflow)"
             : code == SEGV_ACCERR ? "invalid memory reference: no permission for the access"
                                   : "invalid memory reference";
    case SIGBUS: return "bus error (misaligned or truncated mapping)";
    case SIGILL: return "illegal instruction (an instruction this CPU lacks, or a trap)";
    case SIGFPE: return code == FPE_INTDIV ? "integer division by zero" : "arithmetic exception";
    case SIGABRT: return "abort() (an assertion, std::terminate, or heap corruption found by the allocator)";
    default: return "";
  }
}

void report_and_die(int sig, siginfo_t* info, void* context) {
  if ((sig == SIGSEGV || sig == SIGBUS) && g_wasm_trap != nullptr && g_wasm_trap(sig, info, context)) {
    return;  // a WebAssembly bounds check: V8 resumes at its landing pad
  }
  // One report per process: a second thread faulting meanwhile goes straight to the default action.
  if (!g_reporting.exchange(true)) {
    Message m;
    char thread_name[17] = {0};
    prctl(PR_GET_NAME, thread_name, 0, 0, 0);
    m.add("\nconduit: FATAL native error: ");
    m.add(signal_name(sig));
    m.add(" (");
    m.add(signal_cause(sig, info ? info->si_code : 0));
    if (info && (sig == SIGSEGV || sig == SIGBUS) && info->si_code > 0) {
      m.add(", address ");
      m.add_number(reinterpret_cast<uintptr_t>(info->si_addr), 16);
    }
    m.add(")\nconduit:   thread ");
    m.add_number(static_cast<uint64_t>(syscall(SYS_gettid)));
    m.add(" \"");
    m.add(thread_name);
    m.add("\" of process ");
    m.add_number(static_cast<uint64_t>(getpid()));
    m.add("; kernel variant ");
    m.add(g_variant.load(std::memory_order_relaxed));
    m.add(" (the last one the addon ran)\nconduit:   backtrace (innermost first):\n");
    m.flush();
    void* frames[kBacktraceFrames];
    const int n = backtrace(frames, kBacktraceFrames);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
    m.add("conduit:   the process now dies by ");
    m.add(signal_name(sig));
    m.add("\n");
    m.flush();
  }
  // The default action, with the signal re-raised: blocked while this handler runs, it is delivered when the
  // handler returns (a fault would also recur on the faulting instruction).
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);
}

const char* sanitizer_present() {
#if defined(__SANITIZE_ADDRESS__)
  return "not installed: built with AddressSanitizer, whose reports replace it";
#elif defined(__SANITIZE_THREAD__)
  return "not installed: built with ThreadSanitizer, whose reports replace it";
#else
  // A sanitizer runtime preloaded into the process installs its own handlers for these signals.
  for (const char* symbol : {"__asan_init", "__tsan_init", "__msan_init", "__ubsan_handle_add_overflow"}) {
    if (dlsym(RTLD_DEFAULT, symbol) != nullptr) return "not installed: a sanitizer runtime is loaded";
  }
  return nullptr;
#endif
}

}  // namespace

bool install_crash_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (const char* why = sanitizer_present()) {
      g_status = why;
      return;
    }
    // backtrace() loads the unwinder (libgcc_s) on its first call, which is not async-signal-safe: do it now.
    void* frames[2];
    backtrace(frames, 2);
    g_wasm_trap = reinterpret_cast<WasmTrapHandler>(
        dlsym(RTLD_DEFAULT, "_ZN2v829TryHandleWebAssemblyTrapPosixEiP9siginfo_tPv"));
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = report_and_die;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (int sig : kSignals) sigaction(sig, &sa, nullptr);
    g_status = "installed";
    g_installed.store(true, std::memory_order_release);
  });
  return g_installed.load(std::memory_order_acquire);
}

const char* crash_handler_status() { return g_status; }

void note_kernel_variant(const char* name) { g_variant.store(name, std::memory_order_relaxed); }

SignalStackScope::SignalStackScope() {
  if (!g_installed.load(std::memory_order_acquire)) return;
  stack_t current;
  if (sigaltstack(nullptr, &current) != 0 || !(current.ss_flags & SS_DISABLE)) return;  // keep an existing one
  void* mem = mmap(nullptr, kSignalStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return;
  stack_t ss;
  ss.ss_sp = mem;
  ss.ss_size = kSignalStackBytes;
  ss.ss_flags = 0;
  if (sigaltstack(&ss, nullptr) != 0) {
    munmap(mem, kSignalStackBytes);
    return;
  }
  stack_ = mem;
}

SignalStackScope::~SignalStackScope() {
  if (!stack_) return;
  stack_t current;
  if (sigaltstack(nullptr, &current) == 0 && current.ss_sp == stack_) {
    stack_t off;
    std::memset(&off, 0, sizeof(off));
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, nullptr);
  }
  munmap(stack_, kSignalStackBytes);
}

// ---------------------------------------------------------------------------------------------------------------
// Deliberate crashes for the tests

namespace {

volatile int g_zero = 0;
volatile bool g_keep_recursing = true;

__attribute__((noinline)) int recurse_forever(volatile char* previous) {
  volatile char frame[1024];
  frame[0] = previous ? previous[0] : 1;
  frame[sizeof(frame) - 1] = frame[0];
  // Not a tail call (the result is used after it returns), and not provably infinite to the compiler.
  return g_keep_recursing ? recurse_forever(frame) + frame[sizeof(frame) - 1] : frame[0];
}

void crash(const char* kind) {
  if (std::strcmp(kind, "segv") == 0) {
    volatile int* volatile p = nullptr;  // both volatile: the compiler may neither drop the store nor see the null
    *p = 1;
  } else if (std::strcmp(kind, "stack-overflow") == 0) {
    recurse_forever(nullptr);
  } else if (std::strcmp(kind, "fpe") == 0) {
    volatile int dividend = 7;  // volatile: a constant dividend lets the compiler replace the idiv by compares
    volatile int x = dividend / g_zero;
    (void)x;
  } else if (std::strcmp(kind, "ill") == 0) {
    __builtin_trap();
  } else if (std::strcmp(kind, "bus") == 0) {
    raise(SIGBUS);
  } else if (std::strcmp(kind, "abort") == 0) {
    std::abort();
  }
}

}  // namespace

bool crash_for_test(const char* kind) {
  static const char* const kKinds[] = {"segv", "stack-overflow", "fpe", "ill", "bus", "abort"};
  const size_t len = std::strlen(kind);
  const bool on_pool = len > 5 && std::strcmp(kind + len - 5, "-pool") == 0;
  const std::string base = on_pool ? std::string(kind, len - 5) : std::string(kind);
  bool known = false;
  for (const char* k : kKinds) known = known || base == k;
  if (!known) return false;
  if (!on_pool) {
    crash(base.c_str());
    return true;
  }
  // On a pool worker thread: thread 1 of a two-thread pool crashes, the caller waits for it.
  ThreadPool pool(2);
  pool.run_on_all(
      [](void* ctx, int thread_index) {
        if (thread_index == 1) crash(static_cast<const std::string*>(ctx)->c_str());
      },
      const_cast<std::string*>(&base));
  return true;
}

}  // namespace conduit
