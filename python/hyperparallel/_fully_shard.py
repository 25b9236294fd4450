"""fully_shard: FSDP2's signature, on the C++ core (one engine for C++ and Python)."""

import functools
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _C
from ._fsdp_module import FSDPModule
from ._mesh_groups import mesh_groups, post_forward_group
from ._module_state import ModuleState

_fsdp_classes: dict[type, type] = {}
_live_states: "weakref.WeakSet[ModuleState]" = weakref.WeakSet()


def fully_shard(
    module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    all_gather_codec: str = "none",
    reduce_scatter_codec: str = "none",
    codec_block_size: int = 256,
    error_feedback: bool = False,
    comm_fusion: bool | None = None,
    comm_fusion_bucket_bytes: int = 0,
    replicate_params: set[nn.Parameter] | None = None,
):
    """Shards ``module``'s parameters (those no fully_shard-ed submodule manages) over
    ``mesh`` as FSDP2's fully_shard does; a list of modules shares one state.

    Beyond FSDP2: ``all_gather_codec`` / ``reduce_scatter_codec`` ("none", "int8", "fp8")
    quantize the collectives in blocks of ``codec_block_size`` values, ``error_feedback``
    carries the reduce-scatter's quantization error to the next step; ``comm_fusion`` moves
    each module's parameters in one collective (``comm_fusion_bucket_bytes`` splits it; the
    default, None, fuses where the parameters are gathered in one dtype, as FSDP2 gathers
    a module's parameters together, and per parameter otherwise);
    ``replicate_params`` are kept whole on every rank, their gradients all-reduced.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError("fully_shard takes an nn.Module or a non-empty list of them")
    for m in modules:
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this module ({type(m).__name__}); "
                "apply it once per module"
            )
    mesh = mesh if mesh is not None else _default_mesh()
    taken = _params_of_sharded_submodules(modules)
    options = _options(
        modules, mesh, taken, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy
    )
    core_options = options.core
    core_options.ignored_params = list(ignored_params or ())
    comm = core_options.comm_policy
    comm.all_gather_codec = _C.parse_comm_codec(all_gather_codec)
    comm.reduce_scatter_codec = _C.parse_comm_codec(reduce_scatter_codec)
    comm.block_size = codec_block_size
    comm.error_feedback = error_feedback
    core_options.comm_fusion = (
        comm_fusion
        if comm_fusion is not None
        else _gathered_in_one_dtype(modules, taken, ignored_params, mp_policy)
    )
    core_options.comm_fusion_bucket_bytes = comm_fusion_bucket_bytes
    core_options.replicate_params = list(replicate_params or ())
    core_state = _C.ShardState(
        _candidates(modules),
        taken,
        mesh_groups(mesh),
        options,
        [s.core for s in _live_states],
        _subtree_of([weakref.ref(m) for m in modules]),
    )
    state = ModuleState(modules, core_state, mesh)
    _live_states.add(state)
    for m in modules:
        m._hyperparallel_state = state
        m.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
        cls = type(m)
        if cls not in _fsdp_classes:
            _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = _fsdp_classes[cls]
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Runs fully_shard's forward hooks around ``module.<method_name>`` too (e.g. generate)."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name)

    @functools.wraps(method)
    def with_hooks(*args, **kwargs):
        args, kwargs = _pre_forward(module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            module._hyperparallel_state.forward_failed()
            raise
        return _post_forward(module, args, kwargs, output)

    setattr(module, method_name, with_hooks)


# --- hooks ----------------------------------------------------------------------------


def _replace_tensors(tree, replace):
    flat, spec = tree_flatten(tree)
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    for i, tensor in zip(positions, replace([flat[i] for i in positions])):
        flat[i] = tensor
    return tree_unflatten(flat, spec)


def _pre_forward(module, args, kwargs):
    return _replace_tensors((args, kwargs), module._hyperparallel_state.pre_forward)


def _post_forward(module, args, kwargs, output):
    state = module._hyperparallel_state
    if output is None and sys.exc_info()[1] is not None:  # always_call: forward raised
        state.forward_failed()
        return None
    return _replace_tensors(output, state.post_forward)


# --- arguments ----------------------------------------------------------------------


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError(
            "fully_shard without a mesh uses the default process group, and torch.distributed "
            "is not initialized: call dist.init_process_group (e.g. under torchrun) first, or pass mesh"
        )
    backend = dist.get_backend()
    device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _candidates(modules) -> list[tuple[str, torch.Tensor]]:
    named = []
    for i, m in enumerate(modules):
        prefix = f"{i}." if len(modules) > 1 else ""
        for name, param in m.named_parameters():
            named.append((prefix + name, param))
    return named


def _subtree_of(refs):
    def subtree():
        states = []
        for i, ref in enumerate(refs):
            module = ref()
            if module is None:
                continue
            prefix = str(i) if len(refs) > 1 else ""
            for path, sub in module.named_modules(prefix=prefix):
                state = getattr(sub, "_hyperparallel_state", None)
                if state is not None and all(state.core is not s for _, s in states):
                    states.append((path, state.core))
        return states

    return subtree


def _placements(modules, shard_placement_fn, taken) -> dict[str, int | None]:
    placements = {}
    if shard_placement_fn is None:
        return placements
    for name, param in _candidates(modules):
        if id(param) in taken:
            continue
        placement = shard_placement_fn(param)
        if placement is None:
            continue
        if isinstance(placement, Shard):
            placements[name] = placement.dim
        elif isinstance(placement, Replicate):
            placements[name] = None
        else:
            raise ValueError(
                f"shard_placement_fn returned {placement!r} for '{name}'; return Shard(dim), "
                "Replicate() or None (Shard(0))"
            )
    return placements


def _params_of_sharded_submodules(modules) -> list[nn.Parameter]:
    """The parameters earlier fully_shard calls on submodules manage (they belong there)."""
    return [
        p
        for m in modules
        for sub in m.modules()
        if isinstance(sub, FSDPModule)
        for p in sub.parameters()
    ]


def _gathered_in_one_dtype(modules, taken, ignored_params, mp_policy) -> bool:
    """Whether the parameters a call shards are all-gathered in one dtype (what comm_fusion
    packs into one buffer)."""
    if mp_policy.param_dtype is not None:
        return True
    skipped = {id(p) for p in taken} | {id(p) for p in ignored_params or ()}
    return len({p.dtype for _, p in _candidates(modules) if id(p) not in skipped}) <= 1


def _options(
    modules, mesh, taken, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy
) -> "_C.ShardOptions":
    """The options of FSDP2's arguments, checked (the core checks the rest)."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(mp_policy)}"
        )
    if getattr(mp_policy, "param_dtype_override_fn", None) is not None:
        raise NotImplementedError(
            "mp_policy.param_dtype_override_fn is not supported by hyperparallel yet"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(
            f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got {type(offload_policy)}"
        )
    taken_ids = {id(p) for p in taken}
    for name, param in _candidates(modules):
        if id(param) in taken_ids:
            continue
        if getattr(param, "_hyperparallel_managed", False):
            raise ValueError(
                f"parameter '{name}' is already managed by another fully_shard call: an "
                "ancestor's (apply fully_shard to submodules first, then to their ancestors) or "
                "one whose module shares it (tied weights: fully_shard the modules sharing a "
                "parameter together, or their common ancestor)"
            )
        if isinstance(param, DTensor):
            raise NotImplementedError(
                f"parameter '{name}' is already a DTensor (tensor parallel?); hyperparallel's Python "
                "fully_shard takes plain parameters so far"
            )
    options = _C.ShardOptions()
    mp = options.core.mp_policy
    mp.param_dtype = mp_policy.param_dtype
    mp.reduce_dtype = mp_policy.reduce_dtype
    mp.output_dtype = mp_policy.output_dtype
    mp.cast_forward_inputs = mp_policy.cast_forward_inputs
    offload = options.core.offload_policy
    offload.offload = isinstance(offload_policy, CPUOffloadPolicy)
    offload.pin_memory = offload.offload and offload_policy.pin_memory
    options.placements = _placements(modules, shard_placement_fn, taken_ids)
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        options.reshard_after_forward = reshard_after_forward
    elif isinstance(reshard_after_forward, int):
        shard_size = mesh.mesh.size(-1)
        if reshard_after_forward <= 0 or shard_size % reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward} must divide the shard group size "
                f"{shard_size} (e.g. ranks per node); or pass True / False"
            )
        if reshard_after_forward in (1, shard_size):
            options.reshard_after_forward = reshard_after_forward == 1
        else:
            options.reshard_after_forward = True
            options.post_forward_group = post_forward_group(mesh, reshard_after_forward)
    else:
        raise ValueError(
            f"reshard_after_forward must be None, a bool or an int, got {reshard_after_forward!r}"
        )
    return options
