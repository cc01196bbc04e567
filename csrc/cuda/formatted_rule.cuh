// The fused rules on formatted tensors (issue 27): params whose states are
// stored in another format than their own dtype (bf16 states of fp32 masters,
// fp8, int8 and uint8 blocked states) or whose fp32 master is a bf16 weight
// and an int16 remainder. What the CPU kernels' formatted path
// (cpu/kernels.inc: formatted_rule_unit) does, on the device, bit for bit:
// read the fp32 master and each state in fp32 (state_formats.cuh), run the
// rule's amp_math.h arithmetic on them exactly as FusedRuleFunctor does,
// store the master (split again for a remainder master), the model copy and
// each state in its format.
//
// A blocked state is quantized one block at a time, from the block's largest
// magnitude, so a thread block walks its chunk in segments of kSegment
// elements (a multiple of every block size, and chunks are multiples of
// kSegment, so a quantization block never straddles two segments or two
// chunks): each thread updates its elements and leaves the blocked states'
// new values in shared memory; one warp per quantization block reduces its
// absmax; then each thread writes its elements' codes, and the first element's
// thread the block's absmax.
//
// Tensors that are not formatted take FusedRuleFunctor (fused_rule.cuh),
// unchanged: run_rule_with_formats splits the lists between the two.
#pragma once

#include "amp_math.h"
#include "cuda/fused_rule.cuh"
#include "cuda/state_formats.cuh"
#include "state_formats.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

namespace apex_amp {

// Elements per segment of a formatted chunk: validate.h's kMaxStateBlock.
constexpr int kFormattedSegment = 4096;
static_assert(kChunkSize % kFormattedSegment == 0, "chunks must hold whole quantization blocks");
static_assert(kFormattedSegment % kBlockSize == 0, "");
constexpr int kMinStateBlockElements = 32;  // validate.h: kMinStateBlock, one warp's lanes
constexpr int kMaxFormattedStates = 2;

// How the states of one group of formatted tensors are stored: the same for
// every tensor of a launch.
struct StateLayouts {
  StateFormat format[kMaxFormattedStates];
  int block_shift[kMaxFormattedStates];  // log2 of a blocked state's block size, else 0
};

// LAMB's update recomputes the moments: its gradient clip (fused_lamb_cuda.cu).
struct GradClip {
  const float* grad_norm;  // null: no clip (every rule but LAMB)
  float max_grad_norm;
};

// Element e of a formatted tensor's fp32 master: list 0 (fp32 masters, or bf16
// weights joined with their remainders, list `remainder_list`).
template <bool kRemainder, int Depth>
__device__ __forceinline__ float read_formatted_master(const Chunk<Depth>& chunk, int remainder_list, int64_t e) {
  if constexpr (kRemainder) {
    return device_formats::join_master(
        static_cast<const c10::BFloat16*>(chunk.tensor_data[0])[e],
        static_cast<const int16_t*>(chunk.tensor_data[remainder_list])[e]);
  } else {
    return static_cast<const float*>(chunk.tensor_data[0])[e];
  }
}

// Element e of state k (list 2 + k) in fp32; its absmaxes in list absmax_list + k.
template <int Depth>
__device__ __forceinline__ float read_formatted_state(
    const Chunk<Depth>& chunk, const StateLayouts& layouts, int k, int absmax_list, int64_t e) {
  const void* data = chunk.tensor_data[2 + k];
  switch (layouts.format[k]) {
    case StateFormat::kFloat32:
      return static_cast<const float*>(data)[e];
    case StateFormat::kBFloat16:
      return static_cast<float>(static_cast<const c10::BFloat16*>(data)[e]);
    default: {
      const float* absmax = static_cast<const float*>(chunk.tensor_data[absmax_list + k]);
      return device_formats::dequantize(layouts.format[k], data, e, absmax[e >> layouts.block_shift[k]]);
    }
  }
}

// Lists, in TensorEntry order: params (fp32 masters, or bf16 weights), grads,
// the rule's kStates states (any format), then one list that holds the model
// copy (Model not void) or the remainders (kRemainder) or nothing, then one
// absmax list per state (the tensor's first absmax: not offset by the chunk)
// then the tensor's state_rounding row (its stream key and the index of its
// first element in the whole parameter; null: bf16 states round to nearest
// even) and, for rules that take one, a pointer to the tensor's value.
template <typename Hyper, typename Grad, typename Model, bool kRemainder>
struct FormattedRuleFunctor {
  static constexpr bool kLamb = std::is_same<Hyper, LambHyper>::value;
  static constexpr int kStates = Hyper::kStates;
  static constexpr int kSlots = kStates > 0 ? kStates : 1;
  static constexpr bool kReadsGrad = Hyper::kReadsGrad || kLamb;
  static constexpr bool kWritesStates = Hyper::kWritesStates || kLamb;
  static constexpr bool kWritesModel = !std::is_void<Model>::value;
  static constexpr int kExtraList = 2 + kStates;
  static constexpr int kAbsmaxList = kExtraList + 1;
  static constexpr int kRoundingList = kAbsmaxList + kStates;
  static constexpr int kValueList = kRoundingList + 1;
  static constexpr int kDepth = kValueList + (Hyper::kTakesTensorValue ? 1 : 0);
  static_assert(kStates <= kMaxFormattedStates, "");
  static_assert(!(kWritesModel && kRemainder), "remainder masters have no model copy");

  Hyper hyper;
  FusedStepArgs args;
  StateLayouts layouts;
  GradClip clip;

  __device__ float read_master(const Chunk<kDepth>& chunk, int64_t e) const {
    return read_formatted_master<kRemainder>(chunk, kExtraList, e);
  }

  __device__ void write_master(const Chunk<kDepth>& chunk, int64_t e, float p) const {
    if constexpr (kRemainder) {
      device_formats::split_master(
          p, static_cast<c10::BFloat16*>(chunk.tensor_data[0])[e],
          static_cast<int16_t*>(chunk.tensor_data[kExtraList])[e]);
    } else {
      static_cast<float*>(chunk.tensor_data[0])[e] = p;
    }
    if constexpr (kWritesModel) {
      static_cast<Model*>(chunk.tensor_data[kExtraList])[e] = static_cast<Model>(p);
    }
  }

  __device__ float read_state(const Chunk<kDepth>& chunk, int k, int64_t e) const {
    return read_formatted_state(chunk, layouts, k, kAbsmaxList, e);
  }

  __device__ void operator()(const Chunk<kDepth>& chunk) const {
    if (step_is_skipped(args.found_inf)) {  // uniform: see FusedRuleFunctor
      return;
    }
    const float inv_scale = args.inv_scale != nullptr ? *args.inv_scale : 1.f;
    __shared__ Hyper shared_hyper;
    __shared__ float staged[kSlots][kFormattedSegment];  // new values of the blocked states
    __shared__ device_formats::BlockScale scales[kSlots][kFormattedSegment / kMinStateBlockElements];
    if (threadIdx.x == 0) {
      Hyper prepared = hyper;
      prepare_step(prepared, args.step != nullptr ? *args.step + 1.f : 0.f);
      if constexpr (kLamb) {  // as LambMomentsFunctor
        prepared.grad_scale = lamb_grad_scale(*clip.grad_norm * inv_scale, clip.max_grad_norm);
      }
      shared_hyper = prepared;
    }
    __syncthreads();
    const Hyper h = shared_hyper;
    float value = 0.f;
    if constexpr (Hyper::kTakesTensorValue) {
      value = *static_cast<const float*>(chunk.tensor_data[kValueList]);
    }
    bool any_blocked = false;
#pragma unroll
    for (int k = 0; k < kStates; ++k) {
      any_blocked = any_blocked || is_blocked(layouts.format[k]);
    }
    const Grad* grads = static_cast<const Grad*>(chunk.tensor_data[1]);
    // Stochastic rounding of bf16 states (state_formats.h): each state's stream, and
    // the global index of the tensor's first element.
    const int64_t* rounding = static_cast<const int64_t*>(chunk.tensor_data[kRoundingList]);
    uint32_t streams[kSlots] = {};
    int64_t global_first = 0;
    if (rounding != nullptr) {
#pragma unroll
      for (int k = 0; k < kStates; ++k) {
        streams[k] = state_formats::rounding_stream(rounding[0], k);
      }
      global_first = rounding[1];
    }

    for (int base = 0; base < chunk.size; base += kFormattedSegment) {
      const int n = chunk.size - base < kFormattedSegment ? chunk.size - base : kFormattedSegment;
      const int64_t first = chunk.offset + base;  // the segment's first element in the tensor
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t e = first + i;
        float p = read_master(chunk, e);
        float g = 0.f;
        if constexpr (kReadsGrad) {
          g = static_cast<float>(grads[e]) * inv_scale;
        }
        float s[kSlots] = {};
#pragma unroll
        for (int k = 0; k < kStates; ++k) {
          s[k] = read_state(chunk, k, e);
        }
        if constexpr (kLamb) {  // the first pass's moments again (it stored nothing)
          lamb_moments<float>(p, s[0], s[1], g, h);
        }
        fused_rule<float>(p, s, g, h, value);
        write_master(chunk, e, p);
        if constexpr (kWritesStates) {
#pragma unroll
          for (int k = 0; k < kStates; ++k) {
            void* data = chunk.tensor_data[2 + k];
            switch (layouts.format[k]) {
              case StateFormat::kFloat32:
                static_cast<float*>(data)[e] = s[k];
                break;
              case StateFormat::kBFloat16:
                static_cast<c10::BFloat16*>(data)[e] = rounding == nullptr
                    ? static_cast<c10::BFloat16>(s[k])
                    : state_formats::round_bf16_stochastic(
                          s[k], state_formats::rounding_bits(streams[k], global_first + e));
                break;
              default:
                staged[k][i] = s[k];
            }
          }
        }
      }
      if (!kWritesStates || !any_blocked) {
        continue;
      }
      __syncthreads();
      // One warp per quantization block: its lanes' largest magnitudes, combined.
      const int warp = threadIdx.x / 32;
      const int lane = threadIdx.x % 32;
      const int warps = blockDim.x / 32;
#pragma unroll
      for (int k = 0; k < kStates; ++k) {
        if (!is_blocked(layouts.format[k])) {
          continue;
        }
        const int shift = layouts.block_shift[k];
        const int block = 1 << shift;
        for (int b = warp; b < (n >> shift); b += warps) {
          float largest = 0.f;
          bool nan = false;
          for (int j = lane; j < block; j += 32) {
            const float m = device_formats::magnitude(staged[k][(b << shift) + j]);
            nan = nan || m != m;
            largest = m > largest ? m : largest;
          }
          float absmax = nan ? device_formats::quiet_nan() : largest;
#pragma unroll
          for (int delta = 16; delta > 0; delta /= 2) {
            absmax = device_formats::combine_absmax(absmax, __shfl_down_sync(0xffffffffu, absmax, delta));
          }
          if (lane == 0) {
            scales[k][b] = device_formats::block_scale(absmax);
          }
        }
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kStates; ++k) {
        if (!is_blocked(layouts.format[k])) {
          continue;
        }
        const int shift = layouts.block_shift[k];
        float* absmax = static_cast<float*>(chunk.tensor_data[kAbsmaxList + k]);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
          const device_formats::BlockScale& scale = scales[k][i >> shift];
          device_formats::quantize(layouts.format[k], staged[k][i], scale, chunk.tensor_data[2 + k], first + i);
          if ((i & ((1 << shift) - 1)) == 0) {
            absmax[(first + i) >> shift] = scale.stored_absmax;
          }
        }
      }
      // The next segment's values and scales overwrite these only after the
      // next barrier, which every thread reaches after its codes.
    }
  }
};

namespace formatted_rule_detail {

inline StateFormat format_of(const at::Tensor& state) {
  switch (state.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return StateFormat::kFp8;
    case at::kChar:
      return StateFormat::kInt8;
    case at::kByte:
      return StateFormat::kUInt8;
    case at::kBFloat16:
      return StateFormat::kBFloat16;
    default:
      return StateFormat::kFloat32;
  }
}

inline int log2_of(int64_t power_of_two) {
  int shift = 0;
  while ((int64_t{1} << shift) < power_of_two) {
    ++shift;
  }
  return shift;
}

// Formatted tensors that one kernel instantiation and one StateLayouts serve.
template <int Depth>
struct FormattedGroup {
  at::ScalarType grad;
  at::ScalarType model;  // Undefined: no model copy
  StateLayouts layouts;
  std::vector<TensorEntry<Depth>> tensors;
  std::vector<size_t> positions;
};

inline bool same_layouts(const StateLayouts& a, const StateLayouts& b, int states) {
  for (int k = 0; k < states; ++k) {
    if (a.format[k] != b.format[k] || a.block_shift[k] != b.block_shift[k]) {
      return false;
    }
  }
  return true;
}

template <typename Hyper, typename Grad, typename Model, bool kRemainder, int Depth>
void launch_formatted(cudaStream_t stream, const FormattedGroup<Depth>& group, const Hyper& hyper,
                      const FusedStepArgs& args, const GradClip& clip) {
  using Functor = FormattedRuleFunctor<Hyper, Grad, Model, kRemainder>;
  static_assert(Functor::kDepth == Depth, "lists and functor disagree");
  multi_tensor_apply<Depth>(stream, group.tensors, Functor{hyper, args, group.layouts, clip});
}

}  // namespace formatted_rule_detail

// Whether position i of a step is formatted: a remainder master, or a state
// whose dtype is not its param's (cpu/fused_step_cpu.h: StepFormats, the same rule).
inline std::vector<uint8_t> formatted_positions(
    at::TensorList params, std::initializer_list<at::TensorList> states, at::TensorList master_remainders) {
  std::vector<uint8_t> formatted(params.size(), master_remainders.empty() ? 0 : 1);
  for (at::TensorList state : states) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (state[i].scalar_type() != params[i].scalar_type()) {
        formatted[i] = 1;
      }
    }
  }
  return formatted;
}

// The formatted positions of the lists in groups that one kernel
// instantiation and one StateLayouts serve, their entries in
// FormattedRuleFunctor<Hyper, ...>'s list order.
template <typename Hyper>
std::vector<formatted_rule_detail::FormattedGroup<FormattedRuleFunctor<Hyper, float, void, false>::kDepth>>
group_formatted(
    const std::vector<uint8_t>& formatted,
    at::TensorList params,
    at::TensorList grads,
    std::initializer_list<at::TensorList> states,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const float* tensor_values,
    const int64_t* state_rounding) {
  using Detail = FormattedRuleFunctor<Hyper, float, void, false>;
  constexpr int kStates = Hyper::kStates;
  constexpr int kDepth = Detail::kDepth;
  const bool remainders = !master_remainders.empty();
  const size_t count = params.size();
  std::vector<formatted_rule_detail::FormattedGroup<kDepth>> groups;
  for (size_t i = 0; i < count; ++i) {
    if (!formatted[i] || params[i].numel() == 0) {
      continue;
    }
    TensorEntry<kDepth> entry{};
    entry.numel = params[i].numel();
    entry.data[0] = params[i].data_ptr();
    entry.data[1] = Detail::kReadsGrad ? grads[i].data_ptr() : params[i].data_ptr();
    StateLayouts layouts{};
    int k = 0;
    for (at::TensorList state : states) {
      entry.data[2 + k] = state[i].data_ptr();
      layouts.format[k] = formatted_rule_detail::format_of(state[i]);
      if (is_blocked(layouts.format[k])) {
        const at::Tensor& absmax = state_absmaxes[k * count + i];
        layouts.block_shift[k] = formatted_rule_detail::log2_of(state[i].numel() / absmax.numel());
        entry.data[Detail::kAbsmaxList + k] = absmax.data_ptr();
      } else {
        entry.data[Detail::kAbsmaxList + k] = nullptr;
      }
      ++k;
    }
    entry.data[Detail::kRoundingList] =
        state_rounding != nullptr ? const_cast<int64_t*>(state_rounding + 2 * i) : nullptr;
    entry.data[Detail::kExtraList] = remainders ? master_remainders[i].data_ptr()
        : (!model_params.empty() ? model_params[i].data_ptr() : nullptr);
    if constexpr (Hyper::kTakesTensorValue) {  // (none for LAMB's moments pass, which takes no value)
      entry.data[Detail::kValueList] = tensor_values != nullptr ? const_cast<float*>(tensor_values + i) : nullptr;
    }
    const at::ScalarType grad = Detail::kReadsGrad ? grads[i].scalar_type() : at::kFloat;
    const at::ScalarType model = model_params.empty() ? at::ScalarType::Undefined : model_params[i].scalar_type();
    formatted_rule_detail::FormattedGroup<kDepth>* group = nullptr;
    for (auto& candidate : groups) {
      if (candidate.grad == grad && candidate.model == model &&
          formatted_rule_detail::same_layouts(candidate.layouts, layouts, kStates)) {
        group = &candidate;
        break;
      }
    }
    if (group == nullptr) {
      groups.push_back({grad, model, layouts, {}, {}});
      group = &groups.back();
    }
    group->tensors.push_back(entry);
    group->positions.push_back(i);
  }
  return groups;
}

// Runs Hyper's rule over the formatted positions of the lists (the others are
// left alone): run_rule_with_formats's second half.
template <typename Hyper>
void run_formatted_rule(
    cudaStream_t stream,
    const std::vector<uint8_t>& formatted,
    at::TensorList params,
    at::TensorList grads,
    std::initializer_list<at::TensorList> states,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const Hyper& hyper,
    const FusedStepArgs& args,
    const float* tensor_values,
    const GradClip& clip) {
  const bool remainders = !master_remainders.empty();
  const auto groups = group_formatted<Hyper>(
      formatted, params, grads, states, model_params, master_remainders, state_absmaxes, tensor_values,
      args.state_rounding);
  for (const auto& group : groups) {
    dispatch_floating(group.grad, [&](auto grad_tag) {
      using Grad = typename decltype(grad_tag)::type;
      if (remainders) {
        formatted_rule_detail::launch_formatted<Hyper, Grad, void, true>(stream, group, hyper, args, clip);
      } else if (group.model == at::ScalarType::Undefined) {
        formatted_rule_detail::launch_formatted<Hyper, Grad, void, false>(stream, group, hyper, args, clip);
      } else {
        dispatch_floating(group.model, [&](auto model_tag) {
          using Model = typename decltype(model_tag)::type;
          formatted_rule_detail::launch_formatted<Hyper, Grad, Model, false>(stream, group, hyper, args, clip);
        });
      }
    });
  }
}

// run_fused_rule (fused_rule.cuh) for a step that may hold formatted tensors:
// those take FormattedRuleFunctor, the others FusedRuleFunctor exactly as
// before formats existed. state_absmaxes as the op takes them (validate.h).
template <typename Hyper>
void run_rule_with_formats(
    cudaStream_t stream,
    at::TensorList params,
    at::TensorList grads,
    std::initializer_list<at::TensorList> states,
    at::TensorList model_params,
    at::TensorList master_remainders,
    at::TensorList state_absmaxes,
    const Hyper& hyper,
    const FusedStepArgs& args,
    const float* tensor_values = nullptr,
    const GradClip& clip = GradClip{nullptr, 0.f}) {
  const std::vector<uint8_t> formatted = formatted_positions(params, states, master_remainders);
  if (std::find(formatted.begin(), formatted.end(), 1) == formatted.end()) {
    run_fused_rule(stream, params, grads, states, model_params, hyper, args, tensor_values);
    return;
  }
  run_fused_rule(stream, params, grads, states, model_params, hyper, args, tensor_values, &formatted);
  run_formatted_rule(stream, formatted, params, grads, states, model_params, master_remainders, state_absmaxes,
                     hyper, args, tensor_values, clip);
}

}  // namespace apex_amp
