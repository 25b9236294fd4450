"""HyperParallel for Python: FSDP2's ``fully_shard`` on HyperParallel's C++ core.

    from hyperparallel import fully_shard      # instead of torch.distributed.fsdp's

Parameters become DTensors on the given DeviceMesh, as with FSDP2; unsharding, resharding,
prefetch and the gradient reductions run in the C++ core on torch.distributed's groups.
docs/python.md states the API and what differs from FSDP2.
"""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from ._fsdp_module import FSDPModule, UnshardHandle
from ._fully_shard import fully_shard, register_fsdp_forward_method

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
