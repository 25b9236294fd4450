"""Small models and data the Python package's tests share."""

import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint

STEPS = 4
BATCH_PER_RANK = 4
WIDTH = 16


class MLP(nn.Module):
    """Three linears; 33 hidden rows are uneven over 2 and 4 ranks (the last shard short),
    5 output rows leave the 4th rank's shard empty."""

    def __init__(self, recompute=None):
        super().__init__()
        self.up = nn.Linear(WIDTH, 33)
        self.down = nn.Linear(33, WIDTH)
        self.head = nn.Linear(WIDTH, 5, bias=False)
        self.recompute = recompute  # None, "reentrant" or "non_reentrant"

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.recompute is None:
            h = self.down(h)
        else:
            h = checkpoint.checkpoint(self.down, h, use_reentrant=self.recompute == "reentrant")
        return self.head(torch.relu(h))


def batches(world_size, steps=STEPS):
    """The global batch of each step; rank r trains on rows [r * B, (r + 1) * B)."""
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(world_size * BATCH_PER_RANK, WIDTH, generator=generator) for _ in range(steps)
    ]


def local_rows(x, rank):
    return x[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
