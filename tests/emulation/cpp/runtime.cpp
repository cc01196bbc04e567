// The emulated device: launch checks, the block scheduler, barriers and warp
// exchanges of cuda_emulation.h, and the runtime's error state.
#include "cuda_emulation.h"
#include "fiber.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace apex_amp::emulation {
namespace {

// Limits of every GPU since compute capability 3.0.
constexpr unsigned int kWarpSize = 32;
constexpr unsigned int kMaxThreadsPerBlock = 1024;
constexpr unsigned int kMaxBlockDimXY = 1024;
constexpr unsigned int kMaxBlockDimZ = 64;
constexpr unsigned int kMaxGridDimX = 2147483647u;
constexpr unsigned int kMaxGridDimYZ = 65535;
// Dynamic shared memory a launch may ask for without opting in per kernel.
constexpr size_t kMaxDynamicSharedBytes = 48 * 1024;

enum class ThreadState { kRunnable, kAtBarrier, kAtWarpExchange, kExited };

struct EmulatedThread {
  Fiber fiber;
  ThreadIndices indices;
  unsigned int linear;  // x + X * (y + Y * z), as CUDA numbers lanes and warps
  ThreadState state;
  SourceSite site;  // where it waits
  // The warp exchange it waits at.
  unsigned int mask;
  const void* value;
  void* result;
  size_t size;
  unsigned int source_lane;
};

struct BlockRun {
  const LaunchConfig* config;
  void (*thread_body)(const void*);
  const void* payload;
  std::vector<EmulatedThread> threads;
};

// Per OS thread, like CUDA's per-host-thread state.
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local bool t_error_checked = true;
thread_local int t_device_guards = 0;
thread_local BlockRun* t_block = nullptr;
thread_local EmulatedThread* t_thread = nullptr;
thread_local uint64_t t_launch_count = 0;
thread_local FiberStacks t_stacks;

// The address of this object is the emulated device's only stream.
CUstream_st* const kCurrentStream = reinterpret_cast<CUstream_st*>(uintptr_t{0x5eed});

std::string format(const char* pattern, va_list args) {
  char text[1024];
  std::vsnprintf(text, sizeof(text), pattern, args);
  return text;
}

// "multi_tensor_kernel<Depth, Functor> {TensorListMetadata<1>, CheckFiniteFunctor<float>}":
// the kernel as launched, and its parameter types from KernelLaunch's signature.
std::string describe_kernel(const LaunchConfig& config) {
  // GCC writes "... [with Params = {A, B}; size_t = ...]".
  const std::string signature = config.kernel_signature;
  const size_t open = signature.find("Params = {");
  std::string types;
  if (open != std::string::npos) {
    int depth = 0;
    for (size_t at = open + 9; at < signature.size(); ++at) {
      depth += signature[at] == '{' ? 1 : signature[at] == '}' ? -1 : 0;
      if (depth == 0) {
        types = signature.substr(open + 9, at - open - 8);
        break;
      }
    }
  }
  for (const std::string noise : {"apex_amp::", "{anonymous}::", "c10::"}) {
    for (size_t at = types.find(noise); at != std::string::npos; at = types.find(noise)) {
      types.erase(at, noise.size());
    }
  }
  return std::string(config.kernel_name) + (types.empty() || types == "{}" ? "" : " " + types);
}

std::string describe_site(const SourceSite& site) {
  return std::string(site.file) + ":" + std::to_string(site.line);
}

std::string describe_thread(const EmulatedThread& thread) {
  const uint3& t = thread.indices.thread_idx;
  return "thread (" + std::to_string(t.x) + "," + std::to_string(t.y) + "," + std::to_string(t.z) +
      ")";
}

// What a GPU would fault on, or a rule of this project: print where, and abort.
[[noreturn]] __attribute__((format(printf, 2, 3))) void fail(
    const EmulatedThread* thread,
    const char* pattern,
    ...) {
  va_list args;
  va_start(args, pattern);
  const std::string what = format(pattern, args);
  va_end(args);
  std::string where;
  if (t_block != nullptr) {
    const uint3& b = (thread != nullptr ? *thread : t_block->threads[0]).indices.block_idx;
    where = " in kernel " + describe_kernel(*t_block->config) + ", block (" +
        std::to_string(b.x) + "," + std::to_string(b.y) + "," + std::to_string(b.z) + ")";
    if (thread != nullptr) {
      where += ", " + describe_thread(*thread);
    }
  }
  std::fprintf(stderr, "apex_amp CUDA emulation: fault%s: %s\n", where.c_str(), what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Called by AddressSanitizer with a report it is about to print and abort on.
void say_where_the_asan_report_came_from(const char*) {
  if (t_block != nullptr) {
    const EmulatedThread* thread = t_thread;
    const uint3& b = (thread != nullptr ? *thread : t_block->threads[0]).indices.block_idx;
    std::fprintf(stderr, "apex_amp CUDA emulation: this AddressSanitizer report comes from "
                 "kernel %s, block (%u,%u,%u)%s%s\n", describe_kernel(*t_block->config).c_str(),
                 b.x, b.y, b.z,
                 thread != nullptr ? ", " : "",
                 thread != nullptr ? describe_thread(*thread).c_str() : "");
  }
}

EmulatedThread& running_thread(const char* what) {
  if (t_thread == nullptr) {
    fail(nullptr, "%s used outside a kernel", what);
  }
  return *t_thread;
}

// Suspends the running thread until the scheduler lets it go on.
void wait_as(EmulatedThread& thread, ThreadState state, SourceSite site) {
  thread.state = state;
  thread.site = site;
  thread.fiber.suspend();
}

void run_thread(void* erased) {
  auto* thread = static_cast<EmulatedThread*>(erased);
  t_block->thread_body(t_block->payload);
  thread->state = ThreadState::kExited;
}

// Completes every warp exchange whose lanes have all arrived; false if none.
// A lane of a waiting mask that has returned, waits elsewhere, or does not
// exist would leave the exchange waiting for ever on a GPU: a fault.
bool complete_warp_exchanges(BlockRun& run) {
  bool completed = false;
  std::vector<EmulatedThread>& threads = run.threads;
  for (EmulatedThread& waiting : threads) {
    if (waiting.state != ThreadState::kAtWarpExchange) {
      continue;
    }
    const unsigned int warp_first = waiting.linear - waiting.linear % kWarpSize;
    for (unsigned int lane = 0; lane < kWarpSize; ++lane) {
      if ((waiting.mask >> lane & 1u) == 0) {
        continue;
      }
      if (warp_first + lane >= threads.size()) {
        fail(&waiting,
             "warp shuffle at %s: mask 0x%08x names lane %u, which this block does not have",
             describe_site(waiting.site).c_str(), waiting.mask, lane);
      }
      EmulatedThread& peer = threads[warp_first + lane];
      if (peer.state == ThreadState::kExited) {
        fail(&waiting, "warp shuffle at %s: lane %u of mask 0x%08x has returned",
             describe_site(waiting.site).c_str(), lane, waiting.mask);
      }
      if (peer.state == ThreadState::kAtBarrier) {
        fail(&waiting,
             "warp shuffle at %s: lane %u of mask 0x%08x waits at __syncthreads() at %s",
             describe_site(waiting.site).c_str(), lane, waiting.mask,
             describe_site(peer.site).c_str());
      }
      if (peer.site.line != waiting.site.line ||
          std::strcmp(peer.site.file, waiting.site.file) != 0 || peer.mask != waiting.mask ||
          peer.size != waiting.size) {
        fail(&waiting,
             "warp shuffle at %s (mask 0x%08x): lane %u waits at another shuffle, %s (mask 0x%08x)",
             describe_site(waiting.site).c_str(), waiting.mask, lane,
             describe_site(peer.site).c_str(), peer.mask);
      }
    }
    // Every lane of the mask is here: hand each its source lane's value.
    for (unsigned int lane = 0; lane < kWarpSize; ++lane) {
      if ((waiting.mask >> lane & 1u) == 0) {
        continue;
      }
      EmulatedThread& receiver = threads[warp_first + lane];
      if ((waiting.mask >> receiver.source_lane & 1u) == 0) {
        fail(&receiver, "warp shuffle at %s reads lane %u, which is not in mask 0x%08x",
             describe_site(receiver.site).c_str(), receiver.source_lane, waiting.mask);
      }
      const EmulatedThread& source = threads[warp_first + receiver.source_lane];
      std::memcpy(receiver.result, source.value, receiver.size);
    }
    for (unsigned int lane = 0; lane < kWarpSize; ++lane) {
      if ((waiting.mask >> lane & 1u) != 0) {
        threads[warp_first + lane].state = ThreadState::kRunnable;
      }
    }
    completed = true;
  }
  return completed;
}

// With no thread runnable and no exchange to complete, either every thread
// has returned, or every one waits at the same __syncthreads() and all go on.
// Anything else hangs or misbehaves on a GPU: a fault.
bool release_barrier(BlockRun& run) {
  const EmulatedThread* at_barrier = nullptr;
  const EmulatedThread* exited = nullptr;
  for (const EmulatedThread& thread : run.threads) {
    if (thread.state == ThreadState::kAtWarpExchange) {
      fail(&thread, "waits at a warp shuffle at %s that can never complete",
           describe_site(thread.site).c_str());
    }
    if (thread.state == ThreadState::kExited) {
      exited = exited != nullptr ? exited : &thread;
      continue;
    }
    if (at_barrier != nullptr &&
        (thread.site.line != at_barrier->site.line ||
         std::strcmp(thread.site.file, at_barrier->site.file) != 0)) {
      fail(&thread, "waits at __syncthreads() at %s while %s waits at the one at %s",
           describe_site(thread.site).c_str(), describe_thread(*at_barrier).c_str(),
           describe_site(at_barrier->site).c_str());
    }
    at_barrier = at_barrier != nullptr ? at_barrier : &thread;
  }
  if (at_barrier == nullptr) {
    return false;  // all returned: the block is done
  }
  if (exited != nullptr) {
    fail(exited, "returned while other threads of its block wait at __syncthreads() at %s",
         describe_site(at_barrier->site).c_str());
  }
  for (EmulatedThread& thread : run.threads) {
    thread.state = ThreadState::kRunnable;
  }
  return true;
}

void run_block(BlockRun& run, const uint3& block_idx, std::mt19937_64& random) {
  const LaunchConfig& config = *run.config;
  const unsigned int count = config.block.x * config.block.y * config.block.z;
  run.threads.resize(count);
  for (unsigned int linear = 0; linear < count; ++linear) {
    EmulatedThread& thread = run.threads[linear];
    thread.linear = linear;
    thread.indices.thread_idx = {
        linear % config.block.x, linear / config.block.x % config.block.y,
        linear / (config.block.x * config.block.y)};
    thread.indices.block_idx = block_idx;
    thread.indices.block_dim = config.block;
    thread.indices.grid_dim = config.grid;
    thread.state = ThreadState::kRunnable;
    thread.fiber.start(&run_thread, &thread, t_stacks.stack(linear), FiberStacks::kStackBytes);
  }
  // Threads run in a shuffled order between barriers, so that a kernel that
  // relies on an order among them (which a GPU does not promise) shows it.
  std::vector<unsigned int> order(count);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), random);
  do {
    do {
      for (unsigned int linear : order) {
        EmulatedThread& thread = run.threads[linear];
        if (thread.state == ThreadState::kRunnable) {
          t_thread = &thread;
          thread.fiber.resume();
          t_thread = nullptr;
        }
      }
    } while (complete_warp_exchanges(run));
  } while (release_barrier(run));
}

cudaError_t check_config(const LaunchConfig& config) {
  const dim3& b = config.block;
  const dim3& g = config.grid;
  const uint64_t threads = uint64_t{b.x} * b.y * b.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || b.x > kMaxBlockDimXY ||
      b.y > kMaxBlockDimXY || b.z > kMaxBlockDimZ) {
    return cudaErrorInvalidConfiguration;
  }
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > kMaxGridDimX || g.y > kMaxGridDimYZ ||
      g.z > kMaxGridDimYZ) {
    return cudaErrorInvalidConfiguration;
  }
  if (config.shared_bytes > kMaxDynamicSharedBytes) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

uint64_t seed_of_launch() {
  // APEX_AMP_EMULATION_SEED picks another order of blocks and threads.
  static const uint64_t base = [] {
    const char* text = std::getenv("APEX_AMP_EMULATION_SEED");
    return text != nullptr ? std::strtoull(text, nullptr, 10) : uint64_t{12};
  }();
  return base * 1000003u + t_launch_count++;
}

}  // namespace

const ThreadIndices& current_indices() {
  return running_thread("threadIdx/blockIdx/blockDim/gridDim").indices;
}

void sync_threads(SourceSite site) {
  wait_as(running_thread("__syncthreads()"), ThreadState::kAtBarrier, site);
}

void exchange_in_warp(
    SourceSite site,
    unsigned int mask,
    const void* value,
    void* result,
    size_t size,
    unsigned int source_lane) {
  EmulatedThread& thread = running_thread("a warp shuffle");
  if ((mask >> (thread.linear % kWarpSize) & 1u) == 0) {
    fail(&thread, "warp shuffle at %s with mask 0x%08x, which leaves out the calling lane %u",
         describe_site(site).c_str(), mask, thread.linear % kWarpSize);
  }
  thread.mask = mask;
  thread.value = value;
  thread.result = result;
  thread.size = size;
  thread.source_lane = source_lane;
  wait_as(thread, ThreadState::kAtWarpExchange, site);
}

cudaStream_t current_stream() {
  return kCurrentStream;
}

void enter_device_guard() {
  ++t_device_guards;
}

void leave_device_guard() {
  --t_device_guards;
}

void run_kernel(const LaunchConfig& config, void (*thread_body)(const void*), const void* payload) {
  if (t_block != nullptr) {
    fail(t_thread, "kernel %s launched from inside a kernel", config.kernel_name);
  }
  if (!t_error_checked) {
    fail(nullptr, "kernel %s launched while the error of an earlier launch (%s) was never "
         "checked; call C10_CUDA_KERNEL_LAUNCH_CHECK() after every launch",
         config.kernel_name, cudaGetErrorString(t_last_error));
  }
  if (t_device_guards <= 0) {
    fail(nullptr, "kernel %s launched without a device guard; hold a c10::cuda::CUDAGuard for "
         "the tensors' device", config.kernel_name);
  }
  if (config.stream != kCurrentStream) {
    fail(nullptr, "kernel %s launched on stream %p, not on the current stream "
         "(c10::cuda::getCurrentCUDAStream()), so it is not ordered with the caller's work",
         config.kernel_name, static_cast<void*>(config.stream));
  }
#if defined(__SANITIZE_ADDRESS__)
  static const bool callback_set = [] {
    __asan_set_error_report_callback(&say_where_the_asan_report_came_from);
    return true;
  }();
  (void)callback_set;
#endif
  t_error_checked = false;  // cleared by cudaGetLastError()
  const cudaError_t error = check_config(config);
  if (error != cudaSuccess) {
    t_last_error = error;
    return;
  }

  BlockRun run{&config, thread_body, payload, {}};
  std::vector<uint3> blocks;
  blocks.reserve(uint64_t{config.grid.x} * config.grid.y * config.grid.z);
  for (unsigned int z = 0; z < config.grid.z; ++z) {
    for (unsigned int y = 0; y < config.grid.y; ++y) {
      for (unsigned int x = 0; x < config.grid.x; ++x) {
        blocks.push_back({x, y, z});
      }
    }
  }
  // Blocks in a shuffled order too: a GPU runs them in any order, or at once.
  std::mt19937_64 random(seed_of_launch());
  std::shuffle(blocks.begin(), blocks.end(), random);
  t_block = &run;
  for (const uint3& block_idx : blocks) {
    run_block(run, block_idx, random);
  }
  t_block = nullptr;
}

}  // namespace apex_amp::emulation

cudaError_t cudaGetLastError() {
  const cudaError_t error = apex_amp::emulation::t_last_error;
  apex_amp::emulation::t_last_error = cudaSuccess;
  apex_amp::emulation::t_error_checked = true;
  return error;
}

cudaError_t cudaPeekAtLastError() {
  return apex_amp::emulation::t_last_error;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
  }
  return "unknown error";
}
