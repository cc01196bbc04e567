#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define APEX_AMP_START_SWITCH(save, bottom, size) __sanitizer_start_switch_fiber(save, bottom, size)
#define APEX_AMP_FINISH_SWITCH(save, bottom, size) __sanitizer_finish_switch_fiber(save, bottom, size)
#define APEX_AMP_UNPOISON(address, size) __asan_unpoison_memory_region(address, size)
#else
#define APEX_AMP_START_SWITCH(save, bottom, size) ((void)(save), (void)(bottom), (void)(size))
#define APEX_AMP_FINISH_SWITCH(save, bottom, size) ((void)(save), (void)(bottom), (void)(size))
#define APEX_AMP_UNPOISON(address, size) ((void)(address), (void)(size))
#endif

#if !defined(__x86_64__) || !defined(__linux__)
#error "the CUDA emulation's fibers are written for x86-64 Linux (the System V calling convention)"
#endif

// switch_stack(save_sp, load_sp): pushes the callee-saved registers and the
// floating-point control words, stores the stack pointer to *save_sp, loads
// load_sp, and pops the same from there: what the other side pushed when it
// last switched away, or the frame Fiber::start laid out.
extern "C" void apex_amp_emulation_switch_stack(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl apex_amp_emulation_switch_stack
  .hidden apex_amp_emulation_switch_stack
  .type apex_amp_emulation_switch_stack, @function
apex_amp_emulation_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size apex_amp_emulation_switch_stack, .-apex_amp_emulation_switch_stack
)");

namespace apex_amp::emulation {
namespace {

// The running fiber, and the stack of the scheduler that resumed it (for
// AddressSanitizer), per OS thread.
thread_local Fiber* t_running = nullptr;
thread_local void* t_scheduler_sp = nullptr;
thread_local const void* t_scheduler_stack_bottom = nullptr;
thread_local size_t t_scheduler_stack_bytes = 0;

}  // namespace

void Fiber::start(void (*body)(void*), void* arg, char* stack, size_t stack_bytes) {
  body_ = body;
  arg_ = arg;
  stack_ = stack;
  stack_bytes_ = stack_bytes;
  finished_ = false;
  // A fiber's last frames never return (it switches away for good), so their
  // AddressSanitizer redzones would still mark the reused stack.
  APEX_AMP_UNPOISON(stack, stack_bytes);

  // The frame switch_stack pops: the control words, six registers, and
  // entry() as the return address, with a null return address above it so
  // that entry() starts with the stack aligned as after a call, and stack
  // walks stop there.
  auto* top = reinterpret_cast<uint64_t*>(
      (reinterpret_cast<uintptr_t>(stack) + stack_bytes) & ~uintptr_t{15});
  *--top = 0;
  *--top = reinterpret_cast<uint64_t>(&Fiber::entry);
  for (int reg = 0; reg < 6; ++reg) {
    *--top = 0;
  }
  uint32_t control_words[2];
  asm volatile("stmxcsr %0" : "=m"(control_words[0]));
  asm volatile("fnstcw %0" : "=m"(control_words[1]));
  *--top = 0;
  std::memcpy(top, control_words, sizeof(control_words));
  saved_sp_ = top;
}

void Fiber::resume() {
  t_running = this;
  void* fake_stack = nullptr;
  APEX_AMP_START_SWITCH(&fake_stack, stack_, stack_bytes_);
  apex_amp_emulation_switch_stack(&t_scheduler_sp, saved_sp_);
  APEX_AMP_FINISH_SWITCH(fake_stack, nullptr, nullptr);
  t_running = nullptr;
}

void Fiber::suspend() {
  void* fake_stack = nullptr;
  APEX_AMP_START_SWITCH(&fake_stack, t_scheduler_stack_bottom, t_scheduler_stack_bytes);
  apex_amp_emulation_switch_stack(&saved_sp_, t_scheduler_sp);
  APEX_AMP_FINISH_SWITCH(fake_stack, &t_scheduler_stack_bottom, &t_scheduler_stack_bytes);
}

void Fiber::entry() {
  APEX_AMP_FINISH_SWITCH(nullptr, &t_scheduler_stack_bottom, &t_scheduler_stack_bytes);
  Fiber* const self = t_running;
  self->body_(self->arg_);
  self->finished_ = true;
  // nullptr: this stack is done with; its fake frames can go.
  APEX_AMP_START_SWITCH(nullptr, t_scheduler_stack_bottom, t_scheduler_stack_bytes);
  void* discarded_sp = nullptr;
  apex_amp_emulation_switch_stack(&discarded_sp, t_scheduler_sp);
  std::abort();  // never resumed again
}

FiberStacks::~FiberStacks() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (char* region : regions_) {
    munmap(region, page + kStackBytes);
  }
}

char* FiberStacks::stack(size_t index) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  while (regions_.size() <= index) {
    void* region = mmap(
        nullptr, page + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED || mprotect(region, page, PROT_NONE) != 0) {
      std::fprintf(stderr, "apex_amp CUDA emulation: cannot map a fiber stack\n");
      std::abort();
    }
    regions_.push_back(static_cast<char*>(region));
  }
  return regions_[index] + page;
}

}  // namespace apex_amp::emulation
