"""The core's groups for a DeviceMesh: torch.distributed's own process groups, adopted."""

import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _C

# How long a collective may wait before it fails with a named error (torch's default).
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )


def _adopt(group: dist.ProcessGroup, device: torch.device) -> "_C.Group":
    return _C.adopt_process_group(
        group, dist.get_process_group_ranks(group), device, DEFAULT_TIMEOUT
    )


def _own_group(rank_lists: list[list[int]], device: torch.device) -> "_C.Group":
    """A new group for this rank's list; every rank creates every list's group, in order."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return _adopt(mine, device)


def mesh_groups(mesh: DeviceMesh) -> "_C.MeshGroups":
    """The groups fully_shard uses on ``mesh``, made once per mesh (a collective on first use)."""
    cached = getattr(mesh, "_hyperparallel_groups", None)
    if cached is not None:
        return cached
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} ({mesh.ndim} dimensions; "
            "1-D: FSDP, 2-D: HSDP, replicate and shard): pass the data-parallel part, e.g. "
            "mesh['dp_shard'] or mesh['dp_replicate', 'dp_shard']"
        )
    device = mesh_device(mesh)
    names = mesh.mesh_dim_names or (
        ("dp_shard",) if mesh.ndim == 1 else ("dp_replicate", "dp_shard")
    )
    shard_lists = mesh.mesh.reshape(-1, mesh.mesh.size(-1)).tolist()
    shard = _adopt(mesh.get_group(mesh.ndim - 1), device)
    # Reduce-scatters run on a second group over the same ranks, so that they overlap the
    # next all-gathers instead of queueing behind them.
    shard_reduce = _own_group(shard_lists, device)
    if mesh.ndim == 1:
        replicate = _C.group_of_one(dist.get_rank(), device, DEFAULT_TIMEOUT)
        data_parallel = shard
    else:
        replicate = _adopt(mesh.get_group(0), device)
        data_parallel = _own_group([mesh.mesh.flatten().tolist()], device)
    groups = _C.MeshGroups(list(names), shard, shard_reduce, replicate, data_parallel, device)
    mesh._hyperparallel_groups = groups
    return groups


def post_forward_group(mesh: DeviceMesh, k: int) -> "_C.Group":
    """This rank's group of k consecutive shard ranks (reshard_after_forward=k)."""
    cache = mesh.__dict__.setdefault("_hyperparallel_post_forward_groups", {})
    if k not in cache:
        shard_lists = mesh.mesh.reshape(-1, mesh.mesh.size(-1)).tolist()
        blocks = [ranks[i : i + k] for ranks in shard_lists for i in range(0, len(ranks), k)]
        cache[k] = _own_group(blocks, mesh_device(mesh))
    return cache[k]
