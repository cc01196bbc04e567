"""Every public name that NVIDIA apex's ``__init__`` files export (commit e13873de, its last with amp), with
what the compat distribution does with it. Data only: read by tests/test_compat_apex_names.py (which
also checks that docs/third_party_apex.md lists each name) and by the script it runs in the compat venv.

Statuses:

- ``works``: importable, behaves as apex's (the checks of the script test the behaviour);
- ``differs``: importable and works, with differences the documentation's table states;
- ``raises``: importable; calling it raises an error that names the replacement (the
  second element is a part of that message);
- ``refused``: its whole module is not provided; importing it raises ModuleNotFoundError
  naming the replacement (the second element is a part of that message).

The names of ``apex.parallel.distributed`` and ``apex.normalization.fused_layer_norm`` are
module-level names that clients import from there (NVIDIA's BERT: ``flat_dist_call``).
"""

WORKS, DIFFERS = ("works", ""), ("differs", "")


def _raises(replacement):
    return ("raises", replacement)


def _refused(replacement, names):
    return dict.fromkeys(names, ("refused", replacement))


APEX_PUBLIC_NAMES = {
    "apex": {
        "amp": WORKS, "optimizers": WORKS, "normalization": DIFFERS, "parallel": DIFFERS,
        "check_cudnn_version_and_warn": WORKS, "DeprecatedFeatureWarning": WORKS, "deprecated_warning": WORKS,
        "RankInfoFormatter": _raises("logging.Formatter"),
    },
    "apex.amp": {
        "initialize": DIFFERS, "scale_loss": DIFFERS, "disable_casts": WORKS, "state_dict": DIFFERS,
        "load_state_dict": DIFFERS, "master_params": WORKS, "_amp_state": DIFFERS,
        "half_function": WORKS, "float_function": WORKS, "promote_function": WORKS,
        "register_half_function": WORKS, "register_float_function": WORKS, "register_promote_function": WORKS,
        "init": _raises("amp.initialize(model, optimizer, opt_level='O1')"),
    },
    "apex.optimizers": dict.fromkeys(
        ["FusedSGD", "FusedAdam", "FusedNovoGrad", "FusedLAMB", "FusedAdagrad", "FusedMixedPrecisionLamb"], DIFFERS),
    "apex.multi_tensor_apply": {"MultiTensorApply": WORKS, "multi_tensor_applier": WORKS},
    "apex.parallel": {
        "ReduceOp": WORKS, "DistributedDataParallel": DIFFERS, "Reducer": WORKS, "SyncBatchNorm": DIFFERS,
        "convert_syncbn_model": DIFFERS, "create_syncbn_process_group": WORKS,
    },
    "apex.parallel.distributed": {
        "flat_dist_call": WORKS, "apply_flat_dist_call": WORKS, "split_by_type": WORKS,
        "split_half_float_double": WORKS, "flatten": WORKS, "unflatten": WORKS, "extract_tensors": WORKS,
        "Reducer": WORKS, "DistributedDataParallel": DIFFERS,
    },
    "apex.normalization": dict.fromkeys(["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm",
                                         "MixedFusedRMSNorm"], DIFFERS),
    "apex.normalization.fused_layer_norm": dict.fromkeys(
        ["fused_layer_norm_affine", "fused_layer_norm", "mixed_dtype_fused_layer_norm_affine", "fused_rms_norm_affine",
         "fused_rms_norm", "mixed_dtype_fused_rms_norm_affine"], DIFFERS),
    "amp_C": {
        **dict.fromkeys(["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_mp",
                         "multi_tensor_l2norm_scale", "multi_tensor_unscale_l2norm", "update_scale_hysteresis",
                         "multi_tensor_sgd", "multi_tensor_adam", "multi_tensor_adagrad", "multi_tensor_novograd",
                         "multi_tensor_lamb_mp"], WORKS),
        **dict.fromkeys(["multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master", "multi_tensor_lamb",
                         "multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda"], DIFFERS),
    },
    "apex_C": {"flatten": WORKS, "unflatten": WORKS},
    "apex.fp16_utils": _refused("opt_level='O2'", [
        "BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
        "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm", "convert_module",
        "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler", "DynamicLossScaler"]),
    "apex.RNN": _refused("torch.nn.LSTM", ["LSTM", "GRU", "ReLU", "Tanh", "mLSTM"]),
    "apex.mlp": _refused("torch.nn.Linear", ["MLP", "MlpFunction", "mlp_function"]),
    "apex.fused_dense": _refused("torch.nn.Linear", ["FusedDense", "FusedDenseGeluDense", "FusedDenseFunc",
                                                     "DenseNoBiasFunc", "FusedDenseGeluDenseFunc"]),
    # apex's __init__ imports apex.transformer (and nothing of apex.contrib): their names are
    # Megatron's and apex.contrib's, refused as whole modules.
    "apex.transformer": _refused("megatron.core", [
        "amp", "functional", "parallel_state", "pipeline_parallel", "tensor_parallel", "utils", "LayerType",
        "AttnType", "AttnMaskType"]),
}
