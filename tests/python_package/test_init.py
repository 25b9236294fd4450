"""Building and moving a sharded model as FSDP2's users do: meta-device construction,
fully_shard, to_empty() and initialization in place (reset_parameters, or copying a
reference's values into the DTensors), and model.to(dtype) after fully_shard. Each trains
like the single-process reference (fp32 / fp64 at 1e-5)."""

import unittest

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

import hyperparallel
from models import MLP, batches, local_rows
from ranks import run_ranks


def shard(model):
    for layer in (model.up, model.down):
        hyperparallel.fully_shard(layer)
    hyperparallel.fully_shard(model)


def train(model, world_size, rank=None, dtype=torch.float32):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in batches(world_size):
        x = x.to(dtype)
        loss = model(x if rank is None else local_rows(x, rank)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_trains_like(model, reference, world_size, rank, dtype=torch.float32):
    train(reference, world_size, dtype=dtype)
    train(model, world_size, rank, dtype)
    for (name, expected), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        assert p.dtype == dtype and p.to_local().dtype == dtype, (name, p.dtype)
        torch.testing.assert_close(
            p.full_tensor(), expected.detach(), rtol=1e-5, atol=1e-5, msg=name
        )


def reference_model():
    torch.manual_seed(0)
    return MLP()


def meta_init_body(rank, world_size):
    reference = reference_model()
    with torch.device("meta"):
        model = MLP()
    shard(model)
    assert model.up.weight.is_meta
    try:
        model(torch.randn(2, 16))
        raise AssertionError("a forward on meta shards ran")
    except RuntimeError as error:
        assert "meta device" in str(error) and "to_empty" in str(error), error
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()  # in place, on the shards
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu", name
        assert torch.isfinite(p.to_local()).all(), name
    with torch.no_grad():
        for (_, expected), p in zip(reference.named_parameters(), model.parameters()):
            p.copy_(distribute_tensor(expected.detach(), p.device_mesh, p.placements))
    assert_trains_like(model, reference, world_size, rank)


def cast_body(rank, world_size):
    reference = reference_model().to(torch.float64)
    model = reference_model()
    shard(model)
    model.to(torch.float64)
    assert_trains_like(model, reference, world_size, rank, torch.float64)


class TestInit(unittest.TestCase):
    def test_meta_device_init(self):
        run_ranks(2, meta_init_body)

    def test_cast_after_fully_shard(self):
        run_ranks(2, cast_body)


if __name__ == "__main__":
    unittest.main()
