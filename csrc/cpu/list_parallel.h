// How a CPU list op splits its work: the whole tensor list is cut into work
// units (one tensor, one chunk of it), and the units are shared among the
// threads by element count, so that hundreds of small tensors and one huge
// tensor both keep every thread busy.
//
// Only plain data crosses from here into the kernels (raw pointers and
// integers): the kernels are compiled once per instruction set
// (kernels_*.cpp), and keeping ATen types out of their signatures keeps them
// independent of how the rest of the extension is compiled.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace apex_amp::cpu {

// Elements per work unit. The list is cut between threads at unit
// boundaries, so a thread may get up to one unit more or less than its share:
// at 16K elements that is < 3% of each thread's work at 1M parameters on 2
// threads (< 0.2% at 16M), while starting a unit (a dtype switch, a call, one
// finite-check) costs ~50 ns against the ~15-30 us of streaming it. A
// multiple of every vector block (16 or 32 floats) and of the 64-byte cache
// line for every dtype, so only the last unit of a tensor has a scalar tail
// and two threads never write one cache line of a tensor that starts on a
// cache line (as torch allocates them).
constexpr int64_t kChunkElements = 16384;

// Below this many elements per thread, extra threads cost more to wake than
// they save, so a small list runs on the calling thread alone (ATen's
// GRAIN_SIZE, the amount it considers worth a thread).
constexpr int64_t kMinElementsPerThread = 32768;

// A unit costs its elements plus about this many more for the per-unit
// overhead, so that lists of tiny tensors are also shared fairly.
constexpr int64_t kUnitOverheadElements = 256;

// The storage dtypes the kernels read and write: the floating ones, and the
// codes and remainders of state formats (read only through state_formats.h).
enum class Storage : uint8_t { kFloat32, kFloat16, kBFloat16, kFloat8E4M3, kInt8, kUInt8, kInt16 };

struct WorkUnit {
  int64_t tensor;  // index into the lists
  int64_t begin;   // first element of the chunk
  int64_t size;    // number of elements, > 0
};

// The work units, and which of them each thread runs: part t runs units
// [part_bounds[t], part_bounds[t + 1]).
struct PlanView {
  const WorkUnit* units;
  int64_t num_units;
  const int64_t* part_bounds;
  int64_t num_parts;
};

// One tensor list as the kernels see it: base pointer and storage per tensor.
struct OperandView {
  char* const* data;
  const Storage* storage;
};

class ListPlan {
 public:
  // Units over the tensors of `list` (the other lists of the op have the same
  // sizes, checked by the caller).
  explicit ListPlan(at::TensorList list);

  PlanView view() const;
  int64_t num_units() const {
    return static_cast<int64_t>(units_.size());
  }
  const std::vector<WorkUnit>& units() const {
    return units_;
  }

 private:
  std::vector<WorkUnit> units_;
  std::vector<int64_t> part_bounds_;
};

class ListOperand {
 public:
  explicit ListOperand(at::TensorList list);
  OperandView view() const;

 private:
  std::vector<char*> data_;
  std::vector<Storage> storage_;
};

Storage storage_of(at::ScalarType dtype);

}  // namespace apex_amp::cpu
