"""A plain PyTorch distributed program, as users run under torchrun: joins with
init_process_group (env://, Gloo) and all-reduces its rank. Exits 77 when python3 has no
torch.distributed (the calling test skips)."""

import sys

try:
    import torch
    import torch.distributed as dist
except ImportError:
    sys.exit(77)

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
world = dist.get_world_size()
expected = world * (world + 1) / 2
print(f"rank {dist.get_rank()} of {world}: sum {value.item():g}, expected {expected:g}")
dist.destroy_process_group()
sys.exit(0 if value.item() == expected else 1)
