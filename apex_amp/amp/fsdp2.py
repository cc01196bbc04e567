"""amp on models sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): the fp32 shards are the masters.

* **Where the masters live.** ``fully_shard`` turns every parameter into an
  fp32 DTensor holding this rank's shard, and all-gathers it for each forward
  in its ``MixedPrecisionPolicy.param_dtype``. Under O2 that all-gathered half
  copy is the half model, and the fp32 shards the optimizer holds are the
  master weights: amp makes no copy of its own (no ``MasterLink``), every
  parameter is *direct* (``master_weights.py``), and each rank's optimizer
  state and masters are about 1/world of the unsharded total.
* **Who sets the policy.** The user, in the ``fully_shard`` calls; amp checks
  it. ``fully_shard`` fixes the policy when it builds the parameter groups
  (and casts the forward inputs by it), so changing it afterwards would mean
  writing FSDP2's private state. Every inconsistency raises a ``ValueError``
  naming the ``mp_policy`` to pass: the compute dtype must be the level's
  (O2: ``half_dtype``; O0/O1: fp32, O1 casting per op itself), gradients must
  be reduced in fp32 (``reduce_dtype=torch.float32``: the fp32 masters get
  fp32 sums), BatchNorm under ``keep_batchnorm_fp32`` must be sharded on its
  own in fp32, every parameter must be sharded (``fully_shard`` the root too),
  and the optimizer must hold the sharded parameters. O3 (half weights and no
  fp32 copy) has no sharded form: the shards are fp32, so O3 is refused in
  favour of O2, which costs no extra full-size copy here.
* **Remainder masters** (``master_weights="remainder"``): the shards become
  bf16, the high halves of the fp32 masters, and the fused optimizer keeps the
  low halves beside them (int16 DTensors sharded alike). amp casts them at
  ``initialize`` through ``Module._apply``, which ``fully_shard``'s modules
  override (``model_casting.py``), before FSDP2 reads their dtype at the first
  forward (a model that ran one is refused). The policy is O2's: FSDP2 then
  all-gathers the bf16 shards as they are and rounds each fp32 gradient sum to
  a bf16 gradient shard.
* **The step on the shards.** FSDP2 reduce-scatters each gradient into an fp32
  DTensor shard; amp checks and unscales the local shards (``_multi_tensor``
  and FusedAdam run on ``to_local()`` tensors), and the step updates each
  rank's shard only. Each rank checks a different shard, so the session
  MAX-reduces found-inf over the mesh's process group once per checked pass.
* **Accumulation.** Under ``set_requires_gradient_sync(False)`` FSDP2 keeps the
  unsharded gradient sums inside itself, where amp cannot see them, until a
  synchronising backward reduce-scatters them. Such a pass is taken as
  ``delay_unscale=True`` (kept scaled, unchecked, the scale unchanged), as for
  DDP's ``no_sync()``, so the synchronising pass checks the whole sum once.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from .._dtensor import is_dtensor
from .._dtypes import HALF_DTYPES
from .._torch_compat import fsdp2_param_groups
from .recipe import Recipe

__all__ = ["ShardedModels", "check_fsdp2_models", "fsdp2_modules", "refuse_late_sharding"]

_FP32 = torch.float32


def _fsdp2_class() -> Optional[type]:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp2_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module of ``model`` that ``fully_shard`` was applied to."""
    cls = _fsdp2_class()
    if cls is None:
        return []
    return [(name, module) for name, module in model.named_modules() if isinstance(module, cls)]


def _policy_str(param_dtype: torch.dtype, with_reduce: bool = True) -> str:
    fields = [] if param_dtype == _FP32 else [f"param_dtype={param_dtype}"]
    if with_reduce:
        fields.append("reduce_dtype=torch.float32")
    return f"MixedPrecisionPolicy({', '.join(fields)})"


def _policy_of(module: nn.Module) -> Any:
    # fully_shard keeps the policy it was given on the module's state; there is no public getter.
    policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
    if policy is None:
        raise RuntimeError(
            f"apex_amp cannot read fully_shard's MixedPrecisionPolicy in torch {torch.__version__} (FSDP2's "
            "state has no _mp_policy); please report this with your torch version"
        )
    return policy


def _own_params(module: nn.Module, cls: type) -> Iterator[tuple[nn.Module, Tensor]]:
    # (owning module, param) of the params fully_shard(module) manages: its subtree's, minus nested FSDP2 modules'.
    stack = [module]
    while stack:
        current = stack.pop()
        for param in current.parameters(recurse=False):
            yield current, param
        stack.extend(child for child in current.children() if not isinstance(child, cls))


def _shard_name(name: str) -> str:
    return f"model.{name}" if name else "model"


class ShardedModels:
    """The models of one ``initialize`` that FSDP2 shards, and where their ranks agree on found-inf."""

    def __init__(self, models: list[nn.Module], modules: list[nn.Module], process_group: Any) -> None:
        self._models = weakref.WeakSet(models)
        self._modules = [weakref.ref(module) for module in modules]
        self.process_group = process_group

    def holds(self, model: nn.Module) -> bool:
        return model in self._models

    @staticmethod
    def holds_param(param: Tensor) -> bool:
        return is_dtensor(param)

    def skips_grad_sync(self) -> bool:
        """Whether a backward now would accumulate inside FSDP2 (``set_requires_gradient_sync(False)``)."""
        for ref in self._modules:
            module = ref()
            if module is None:
                continue
            groups = fsdp2_param_groups(module._get_fsdp_state())
            if any(not group.reduce_grads for group in groups):
                return True
        return False


def _check_policy(name: str, module: nn.Module, cls: type, properties: Recipe) -> None:
    owned = [(owner, p) for owner, p in _own_params(module, cls) if p.is_floating_point()]
    if not owned:
        return  # nothing all-gathered here: the policy only casts the inputs, which amp casts too
    compute_dtype = properties.fsdp2_param_dtype(batchnorm=False)
    keep_bn = properties.fsdp2_param_dtype(batchnorm=True) != compute_dtype
    batchnorms = {id(owner) for owner, _ in owned if isinstance(owner, _BatchNorm)}
    if keep_bn and batchnorms and len(batchnorms) < len({id(owner) for owner, _ in owned}):
        bn_name = next(n for n, m in module.named_modules() if id(m) in batchnorms)
        raise ValueError(
            f"{_shard_name(name)} was sharded by fully_shard together with the BatchNorm "
            f"{_shard_name(name + '.' + bn_name if name else bn_name)}, so both would be all-gathered in one "
            f"dtype, but {properties.opt_level} keeps BatchNorm in fp32 (keep_batchnorm_fp32=True). Shard each "
            f"BatchNorm on its own first, fully_shard(batchnorm, mp_policy={_policy_str(_FP32)}), then its "
            "parents; or pass keep_batchnorm_fp32=False to compute BatchNorm in "
            f"{compute_dtype}"
        )
    expected = _FP32 if keep_bn and batchnorms else compute_dtype
    policy = _policy_of(module)
    param_dtype = policy.param_dtype or _FP32
    reduce_dtype = policy.reduce_dtype or param_dtype
    if param_dtype == expected and reduce_dtype == _FP32:
        return
    if param_dtype != expected:
        if expected in HALF_DTYPES:
            why = f"opt_level={properties.opt_level} computes in {expected} (FSDP2 all-gathers the half model)"
        elif batchnorms:
            why = "BatchNorm stays fp32 under keep_batchnorm_fp32=True"
        else:
            why = (f"opt_level={properties.opt_level} keeps the model fp32"
                   + (" and casts per op itself" if properties.patch_torch_functions else ""))
        problem = f"all-gathers it in {param_dtype}, but {why}"
    else:
        problem = (f"reduces its gradients in {reduce_dtype}, but amp's fp32 masters need fp32 sums "
                   "(a half reduction loses the bits they keep)")
    scope = "to every fully_shard call of the model" if expected == compute_dtype else "to this BatchNorm's fully_shard"
    raise ValueError(
        f"{_shard_name(name)} was sharded by fully_shard with {policy}, which {problem}. Pass "
        f"mp_policy={_policy_str(expected)} {scope}, e.g. fully_shard({_shard_name(name)}, "
        f"mp_policy={_policy_str(expected)}), or choose the opt_level/half_dtype that matches the policy"
    )


def _refuse_a_forward_before_initialize(index: int, modules: list[tuple[str, nn.Module]], properties: Recipe) -> None:
    # amp casts the shards themselves (remainder masters): FSDP2 reads their dtype, which its
    # reduce-scatter casts the gradients back to, once, at the root's first forward (its lazy init).
    for name, module in modules:
        if getattr(module._get_fsdp_state(), "_is_root", None) is not None:
            raise ValueError(
                f"model {index} ran a forward before amp.initialize, and fully_shard ({_shard_name(name)}) fixed "
                f"its parameters' dtype at that first forward; master_weights='remainder' stores the shards in "
                f"{properties.fsdp2_shard_dtype(batchnorm=False)} (the high halves of the fp32 masters), which amp "
                "casts at initialize. Build the model, fully_shard it, build the optimizer, and call "
                "amp.initialize before the first forward"
            )


def _process_group(params: Iterable[Tensor]) -> Any:
    # Found-inf is agreed over the ranks the shards are spread on: the 1-D mesh's group (all
    # ranks for a 2-D, hybrid-sharded mesh, whose replicas hold equal shards anyway).
    groups = []
    for param in params:
        mesh = param.device_mesh
        group = mesh.get_group() if mesh.ndim == 1 else torch.distributed.group.WORLD
        if all(group is not seen for seen in groups):
            groups.append(group)
    return groups[0] if len(groups) == 1 else torch.distributed.group.WORLD


def check_fsdp2_models(
    models: list[nn.Module], optimizers: list[torch.optim.Optimizer], properties: Recipe
) -> Optional[ShardedModels]:
    """Check every FSDP2 setup rule (module docstring) for ``models``; None when none is sharded by FSDP2."""
    cls = _fsdp2_class()
    found = [(index, fsdp2_modules(model)) for index, model in enumerate(models)]
    found = [(index, modules) for index, modules in found if modules]
    if cls is None or not found:
        return None
    refusal = properties.fsdp2_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    if properties.fsdp2_shard_dtype(batchnorm=False) != _FP32:
        for index, modules in found:
            _refuse_a_forward_before_initialize(index, modules, properties)
    compute_dtype = properties.fsdp2_param_dtype(batchnorm=False)
    sharded_models, all_modules, sharded_params = [], [], []
    for index, modules in found:
        model = models[index]
        for name, param in model.named_parameters():
            if not is_dtensor(param):
                raise ValueError(
                    f"parameter {name!r} of model {index} is not sharded (fully_shard was applied to some "
                    "submodules but not to one that owns this parameter, or it was in ignored_params), so its "
                    "gradient would be neither reduced nor in the model's compute dtype. Call fully_shard on the "
                    f"root too, after its submodules: fully_shard(model, mp_policy={_policy_str(compute_dtype)})"
                )
            sharded_params.append(param)
        for name, module in modules:
            _check_policy(name, module, cls, properties)
        sharded_models.append(model)
        all_modules.extend(module for _, module in modules)
    model_params = {p for model in models for p in model.parameters()}
    for o_index, optimizer in enumerate(optimizers):
        for param in (p for group in optimizer.param_groups for p in group["params"]):
            if not is_dtensor(param) and param not in model_params:
                raise ValueError(
                    f"optimizers[{o_index}] holds a parameter of shape {tuple(param.shape)} that belongs to none "
                    "of the models, and fully_shard replaced every parameter of the sharded model by a DTensor: "
                    "the optimizer was built before fully_shard. Call fully_shard first, then build the optimizer "
                    "from model.parameters(), then amp.initialize"
                )
    return ShardedModels(sharded_models, all_modules, _process_group(sharded_params))


def refuse_late_sharding(model: nn.Module, index: int) -> RemovableHandle:
    """A forward pre-hook raising if ``model`` was sharded by ``fully_shard`` after ``initialize``; removed once it was not."""
    handle: Optional[RemovableHandle] = None

    @torch.compiler.disable  # one look at the first forward
    def check(module: nn.Module, args: tuple) -> None:
        sharded = fsdp2_modules(module)
        if not sharded:
            handle.remove()
            return
        raise RuntimeError(
            f"model {index} was sharded by fully_shard ({_shard_name(sharded[0][0])}) after amp.initialize, so the "
            "optimizer and amp hold parameters the model no longer uses. Under FSDP2 the order is: fully_shard "
            "(submodules, then the root), then build the optimizer from model.parameters(), then "
            "amp.initialize(model, optimizer, ...)"
        )

    handle = model.register_forward_pre_hook(check)
    return handle
