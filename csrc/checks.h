// Argument validation shared by the CPU and the CUDA launchers.
//
// Every message names the op, the argument (with its list index) and what was
// expected, so a user who hands us the wrong tensor knows which one and why.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace apex_amp {

inline std::string dtype_names(std::initializer_list<at::ScalarType> dtypes) {
  std::string names;
  for (auto dtype : dtypes) {
    if (!names.empty()) {
      names += ", ";
    }
    names += c10::toString(dtype);
  }
  return names;
}

inline bool dtype_in(at::ScalarType dtype, std::initializer_list<at::ScalarType> dtypes) {
  for (auto allowed : dtypes) {
    if (dtype == allowed) {
      return true;
    }
  }
  return false;
}

// The floating dtypes every list op accepts.
constexpr std::initializer_list<at::ScalarType> kFloatingDtypes = {
    at::kFloat, at::kHalf, at::kBFloat16};

inline void check_same_length(
    const char* op,
    const char* name_a,
    at::TensorList a,
    const char* name_b,
    at::TensorList b) {
  TORCH_CHECK(
      a.size() == b.size(), "apex_amp.", op, ": ", name_a, " and ", name_b,
      " must be lists of the same length, got ", a.size(), " and ", b.size());
}

// Each tensor: defined, on `device`, of one of `dtypes`, and dense: its
// elements fill one block of memory, in any order of the dimensions
// (contiguous, channels_last, channels_last_3d, permuted). The kernels walk
// that block from data_ptr() as a flat array, which reaches every element
// exactly once; an expanded tensor (elements repeated) or a strided slice
// (gaps) has no such block and is refused.
inline void check_tensor_list(
    const char* op,
    const char* name,
    at::TensorList list,
    const at::Device& device,
    std::initializer_list<at::ScalarType> dtypes = kFloatingDtypes) {
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.defined(), "apex_amp.", op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(
        t.device() == device, "apex_amp.", op, ": ", name, "[", i, "] is on ", t.device(),
        " but the op runs on ", device, "; move every tensor to one device");
    TORCH_CHECK(
        dtype_in(t.scalar_type(), dtypes), "apex_amp.", op, ": ", name, "[", i, "] has dtype ",
        t.scalar_type(), "; expected one of ", dtype_names(dtypes));
    TORCH_CHECK(
        t.is_non_overlapping_and_dense(), "apex_amp.", op, ": ", name, "[", i,
        "] must be dense (every element stored once, with no gaps, in any memory format), got "
        "sizes ", t.sizes(), " and strides ", t.strides(),
        " (from expand() or a strided slice?); call .contiguous() on it");
  }
}

// Whether dense tensors a and b (of equal numel) order their elements alike
// in memory: both contiguous (their shapes may then differ), or the same
// sizes and the same strides (the stride of a size-1 dimension never matters).
inline bool same_memory_order(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() <= 1 || (a.is_contiguous() && b.is_contiguous())) {
    return true;
  }
  if (a.sizes() != b.sizes()) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) {
      return false;
    }
  }
  return true;
}

// Corresponding tensors of two lists (a[i] and b[i]) are walked together in
// memory order, element k of one with element k of the other: they must hold
// the same number of elements and order them alike (same_memory_order). A
// mismatch is refused rather than copied: autograd gives every gradient its
// parameter's strides, and amp's masters, master gradients and optimizer
// moments are made with *_like, so a mismatch means a buffer made some other
// way, and a hidden copy would double the op's memory traffic.
inline void check_corresponding(
    const char* op,
    const char* name_a,
    at::TensorList a,
    const char* name_b,
    at::TensorList b) {
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(
        a[i].numel() == b[i].numel(), "apex_amp.", op, ": ", name_a, "[", i, "] has ",
        a[i].numel(), " elements but ", name_b, "[", i, "] has ", b[i].numel(),
        "; corresponding tensors must have the same size");
    TORCH_CHECK(
        same_memory_order(a[i], b[i]), "apex_amp.", op, ": ", name_b, "[", i,
        "] has a different memory layout from ", name_a, "[", i, "] (sizes ", b[i].sizes(),
        " and strides ", b[i].strides(), " vs ", a[i].sizes(), " and ", a[i].strides(),
        "); corresponding tensors must share one: make ", name_b, "[", i, "] with torch.empty_like(",
        name_a, "[", i, "]) or convert one with .to(memory_format=...)");
  }
}

// Two tensors written by one op must be the same memory or not overlap at all.
inline void check_no_partial_overlap(
    const char* op,
    const char* name_a,
    at::TensorList a,
    const char* name_b,
    at::TensorList b) {
  for (size_t i = 0; i < a.size(); ++i) {
    const auto overlap = at::get_overlap_status(a[i], b[i]);
    TORCH_CHECK(
        overlap != at::MemOverlapStatus::Partial, "apex_amp.", op, ": ", name_a, "[", i,
        "] and ", name_b, "[", i, "] partially overlap in memory; pass the same tensor or "
        "separate ones");
  }
}

// The tensors of one list that an op writes in place must not share memory:
// an element reached through two entries would be updated twice (unscaled
// twice, two Adam steps), and the result would depend on the backend.
// Every tensor is dense, so its bytes are one range; sorting the ranges
// finds any overlap in O(n log n).
inline void check_disjoint_within(const char* op, const char* name, at::TensorList list) {
  if (list.size() < 2) {
    return;
  }
  struct Span {
    uintptr_t begin;
    uintptr_t end;
    size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    if (t.numel() == 0) {
      continue;
    }
    const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    spans.push_back({begin, begin + static_cast<uintptr_t>(t.numel()) * t.element_size(), i});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.index < b.index;
  });
  for (size_t k = 1; k < spans.size(); ++k) {
    const Span& previous = spans[k - 1];
    const Span& current = spans[k];
    TORCH_CHECK(
        current.begin >= previous.end, "apex_amp.", op, ": ", name, "[",
        std::min(previous.index, current.index), "] and ", name, "[",
        std::max(previous.index, current.index),
        "] share memory; the op writes every entry of ", name,
        ", so each tensor must appear once (remove the duplicate)");
  }
}

// A one-element float32 tensor on `device` (found_inf, inv_scale, scale, step).
inline void check_scalar_tensor(
    const char* op,
    const char* name,
    const at::Tensor& t,
    const at::Device& device,
    at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.defined(), "apex_amp.", op, ": ", name, " is undefined");
  TORCH_CHECK(
      t.numel() == 1, "apex_amp.", op, ": ", name, " must hold exactly one element, got ",
      t.numel());
  TORCH_CHECK(
      t.scalar_type() == dtype, "apex_amp.", op, ": ", name, " must be ", dtype, ", got ",
      t.scalar_type());
  TORCH_CHECK(
      t.device() == device, "apex_amp.", op, ": ", name, " is on ", t.device(),
      " but the op runs on ", device, "; keep it on the same device as the tensors");
}

}  // namespace apex_amp
