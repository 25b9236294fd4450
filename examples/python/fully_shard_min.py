"""FSDP2's fully_shard from hyperparallel: the same program as with torch.distributed.fsdp,
one import changed. Run: torchrun --nproc-per-node 2 examples/python/fully_shard_min.py"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hyperparallel import fully_shard


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    dist.init_process_group("gloo")  # torchrun's environment; nccl on GPUs
    torch.manual_seed(0)
    net = Net()
    fully_shard(net.fc1)  # the blocks first (each gathers only for its own forward),
    fully_shard(net.fc2)
    fully_shard(net)  # then the root; the mesh: all ranks of the default group
    assert isinstance(net.fc1.weight, DTensor)  # this rank's rows of the weight
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)  # on the shards

    batch = torch.randn(8, 64)
    losses = []
    for step in range(10):
        optimizer.zero_grad()
        loss = net(batch).square().mean()
        loss.backward()  # gradients reduce-scattered to the shards
        optimizer.step()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < losses[0]
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
