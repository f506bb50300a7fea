// A fatal native error is never silent: a handler for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT writes what
// happened to stderr (the signal and its cause, the thread, the kernel variant the addon last ran, a short
// backtrace) using only async-signal-safe calls, then re-raises the signal with its default action, so the process
// still dies by that signal (a non-zero exit, a core dump where enabled).
#pragma once

namespace conduit {

// Installs the handlers once per process (later calls return at once) and gives the calling thread an alternate
// signal stack, so that a stack overflow is reported too. Does nothing in a build or process with a sanitizer
// runtime, whose own reports are more precise and whose handlers these would replace. Returns whether the
// handlers are installed.
bool install_crash_handler();

// Whether install_crash_handler installed the handlers, and if not, why ("installed" when it did).
const char* crash_handler_status();

// Records the kernel variant the addon is about to run (a static string), for the message.
void note_kernel_variant(const char* name);

// Gives the calling thread an alternate signal stack for the handler while alive (pool workers hold one), unless
// the thread already has one or no handler is installed.
class SignalStackScope {
 public:
  SignalStackScope();
  ~SignalStackScope();
  SignalStackScope(const SignalStackScope&) = delete;
  SignalStackScope& operator=(const SignalStackScope&) = delete;

 private:
  void* stack_ = nullptr;
};

// Test aid: deliberately crashes this process in the given way ("segv", "segv-pool" (on a pool worker thread),
// "stack-overflow", "stack-overflow-pool", "fpe", "ill", "bus", "abort"). Returns false for an unknown kind.
bool crash_for_test(const char* kind);

}  // namespace conduit
