// Fibers for the emulated threads of a block: each runs on its own stack, and
// a switch between a fiber and the scheduler that resumed it is a plain
// function call (no system call, unlike swapcontext, which made a 512-thread
// block cost milliseconds). AddressSanitizer is told of every switch, so it
// always knows which stack is in use.
#pragma once

#include <cstddef>
#include <vector>

namespace apex_amp::emulation {

class Fiber {
 public:
  // Prepares body(arg) to run on `stack` (stack_bytes long) at the next resume().
  void start(void (*body)(void*), void* arg, char* stack, size_t stack_bytes);
  // From the scheduler: runs the fiber until it suspends or its body returns.
  void resume();
  // From inside the fiber: back to the scheduler that resumed it.
  void suspend();
  bool finished() const {
    return finished_;
  }

 private:
  [[noreturn]] static void entry();

  void (*body_)(void*) = nullptr;
  void* arg_ = nullptr;
  char* stack_ = nullptr;
  size_t stack_bytes_ = 0;
  void* saved_sp_ = nullptr;  // where the fiber's registers wait while it is suspended
  bool finished_ = true;
};

// Stacks for the fibers of one block, reused from block to block. Each has an
// inaccessible guard page below it, so that an overflow faults at once.
class FiberStacks {
 public:
  static constexpr size_t kStackBytes = 64 * 1024;

  FiberStacks() = default;
  FiberStacks(const FiberStacks&) = delete;
  FiberStacks& operator=(const FiberStacks&) = delete;
  ~FiberStacks();

  // The stack of fiber `index`, allocating stacks up to it on first use.
  char* stack(size_t index);

 private:
  std::vector<char*> regions_;  // each: a guard page, then the stack
};

}  // namespace apex_amp::emulation
