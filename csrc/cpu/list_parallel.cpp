#include "cpu/list_parallel.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace apex_amp::cpu {

Storage storage_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return Storage::kFloat32;
    case at::kHalf:
      return Storage::kFloat16;
    case at::kBFloat16:
      return Storage::kBFloat16;
    case at::kFloat8_e4m3fn:
      return Storage::kFloat8E4M3;
    case at::kChar:
      return Storage::kInt8;
    case at::kByte:
      return Storage::kUInt8;
    case at::kShort:
      return Storage::kInt16;
    default:
      // The launchers check dtypes with messages that name the argument
      // first; reaching this is a bug in a launcher.
      TORCH_CHECK(false, "apex_amp: internal error: no CPU kernel for dtype ", dtype);
  }
}

ListPlan::ListPlan(at::TensorList list) {
  int64_t total_cost = 0;
  for (size_t t = 0; t < list.size(); ++t) {
    const int64_t numel = list[t].numel();
    for (int64_t begin = 0; begin < numel; begin += kChunkElements) {
      const int64_t size = std::min(kChunkElements, numel - begin);
      units_.push_back({static_cast<int64_t>(t), begin, size});
      total_cost += size + kUnitOverheadElements;
    }
  }

  const int64_t max_parts = std::max<int64_t>(1, total_cost / kMinElementsPerThread);
  const int64_t num_parts = std::min<int64_t>(at::get_num_threads(), max_parts);

  // Cut the units into num_parts contiguous runs of about equal cost: part t
  // starts at the first unit whose cost prefix reaches t / num_parts of the
  // total.
  part_bounds_.assign(num_parts + 1, static_cast<int64_t>(units_.size()));
  part_bounds_[0] = 0;
  int64_t prefix = 0;
  int64_t part = 1;
  for (size_t u = 0; u < units_.size() && part < num_parts; ++u) {
    // Compare prefix * num_parts with part * total to stay in integers.
    while (part < num_parts && prefix * num_parts >= part * total_cost) {
      part_bounds_[part++] = static_cast<int64_t>(u);
    }
    prefix += units_[u].size + kUnitOverheadElements;
  }
}

PlanView ListPlan::view() const {
  return PlanView{
      units_.data(), static_cast<int64_t>(units_.size()), part_bounds_.data(),
      static_cast<int64_t>(part_bounds_.size()) - 1};
}

ListOperand::ListOperand(at::TensorList list) {
  data_.reserve(list.size());
  storage_.reserve(list.size());
  for (const at::Tensor& t : list) {
    data_.push_back(static_cast<char*>(t.data_ptr()));
    storage_.push_back(storage_of(t.scalar_type()));
  }
}

OperandView ListOperand::view() const {
  return OperandView{data_.data(), storage_.data()};
}

}  // namespace apex_amp::cpu
