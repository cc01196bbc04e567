// Host-side dtype handling for the multi-tensor launchers.
//
// A list op may receive tensors of different dtypes (fp32 master grads next
// to fp16 ones, ...). Rather than one branch per dtype, the launcher groups
// the list positions by their combination of dtypes across the op's lists,
// picks the kernel instantiation once per group, and runs one multi-tensor
// apply per group.
#pragma once

#include "chunk_packing.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <vector>

namespace apex_amp {

template <int Depth>
struct DtypeGroup {
  std::array<at::ScalarType, Depth> dtypes;  // the dtype of each list's tensors
  std::vector<TensorEntry<Depth>> tensors;   // in list order
  std::vector<size_t> positions;             // the list position of each entry
};

// Groups position i of `lists` (all of the same length) by the dtypes of
// lists[0][i] ... lists[Depth-1][i], groups in order of first appearance.
template <int Depth>
std::vector<DtypeGroup<Depth>> group_by_dtype(const std::array<at::TensorList, Depth>& lists) {
  std::vector<DtypeGroup<Depth>> groups;
  const size_t length = lists[0].size();
  for (size_t i = 0; i < length; ++i) {
    std::array<at::ScalarType, Depth> dtypes;
    TensorEntry<Depth> entry;
    for (int list = 0; list < Depth; ++list) {
      const at::Tensor& t = lists[list][i];
      dtypes[list] = t.scalar_type();
      entry.data[list] = t.data_ptr();
    }
    entry.numel = lists[0][i].numel();

    DtypeGroup<Depth>* group = nullptr;
    for (auto& candidate : groups) {  // a handful of groups at most
      if (candidate.dtypes == dtypes) {
        group = &candidate;
        break;
      }
    }
    if (group == nullptr) {
      groups.push_back(DtypeGroup<Depth>{dtypes, {}, {}});
      group = &groups.back();
    }
    group->tensors.push_back(entry);
    group->positions.push_back(i);
  }
  return groups;
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the C++ type of a floating dtype the ops accept.
// Validation has already rejected other dtypes; reaching the default is a bug.
template <typename F>
void dispatch_floating(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat:
      f(TypeTag<float>{});
      return;
    case at::kHalf:
      f(TypeTag<at::Half>{});
      return;
    case at::kBFloat16:
      f(TypeTag<at::BFloat16>{});
      return;
    default:
      TORCH_CHECK(false, "apex_amp: internal error: no CUDA kernel for dtype ", dtype);
  }
}

}  // namespace apex_amp
