"""hyperparallel.fully_shard against torch's own FSDP2 on the same model, seeds and data:
the losses of every step and the trained parameters, in fp32 (1e-5) and with bf16
parameters reducing in fp32 (the test plan's 1e-3)."""

import unittest

import torch
import torch.distributed.fsdp as fsdp2
from torch.distributed.fsdp import MixedPrecisionPolicy

import hyperparallel
from models import MLP, batches, local_rows
from ranks import run_ranks

CONFIGS = [
    ({}, 1e-5),
    ({"reshard_after_forward": False}, 1e-5),
    (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        1e-3,
    ),
]


def train(rank, world_size, fully_shard, kwargs):
    torch.manual_seed(0)
    model = MLP()
    for layer in (model.up, model.down):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for x in batches(world_size):
        loss = model(local_rows(x, rank)).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor() for p in model.parameters()]


def body(rank, world_size):
    for kwargs, tolerance in CONFIGS:
        theirs, their_params = train(rank, world_size, fsdp2.fully_shard, kwargs)
        ours, our_params = train(rank, world_size, hyperparallel.fully_shard, kwargs)
        for step, (a, b) in enumerate(zip(theirs, ours)):
            assert abs(a - b) <= tolerance, (kwargs, step, a, b)
        for a, b in zip(their_params, our_params):
            torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance, msg=str(kwargs))


class TestAgainstFSDP2(unittest.TestCase):
    def test_two_ranks(self):
        run_ranks(2, body)


if __name__ == "__main__":
    unittest.main()
