"""hyperparallel.fully_shard against plain single-process PyTorch on the global batch,
fp32 at the test plan's 1e-5, on 2 and 4 ranks: FSDP, HSDP, Shard(1), reshard after
forward as bool and int, a group of modules sharing a state, recompute of both kinds, accumulation without gradient sync,
comm_fusion, clip_grad_norm_ on DTensor gradients, frozen parameters, AdamW's foreach,
fused and for-loop implementations; and a rerun that must be bitwise equal."""

import unittest

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import hyperparallel
from models import MLP, batches, local_rows
from ranks import run_ranks


MAX_NORM = 0.02  # below the gradients' norm: clipping changes every step


def new_model(config):
    torch.manual_seed(0)
    model = MLP(config.get("recompute"))
    if config.get("frozen"):
        model.up.bias.requires_grad_(False)
    return model


def new_optimizer(model, config):
    """AdamW's foreach implementation, or the one config["optimizer"] names."""
    kind = config.get("optimizer", "foreach")
    return torch.optim.AdamW(
        model.parameters(), lr=1e-2, foreach=kind == "foreach", fused=kind == "fused" or None
    )


def reference_run(world_size, config):
    model = new_model(config)
    optimizer = new_optimizer(model, config)
    losses = []
    for x in batches(world_size):
        # Accumulating: microbatch i is every rank's i-th half of its rows.
        halves = [
            torch.cat([local_rows(x, r).chunk(2)[i] for r in range(world_size)]) for i in (0, 1)
        ]
        for microbatch in halves if config.get("accumulate") else [x]:
            loss = model(microbatch).square().mean()
            loss.backward()
        if config.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def sharded_run(rank, world_size, config):
    model = new_model(config)
    mesh = (
        init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        if config.get("hsdp")
        else None
    )
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=config.get("reshard_after_forward"),
        comm_fusion=config.get("comm_fusion", False),
    )
    if config.get("shard_dim_1"):
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else None
    if config.get("group"):
        # One state for both (up's inputs need no gradient, down's do).
        hyperparallel.fully_shard([model.up, model.down], **kwargs)
    else:
        for layer in (model.up, model.down):
            hyperparallel.fully_shard(layer, **kwargs)
    hyperparallel.fully_shard(model, **kwargs)
    optimizer = new_optimizer(model, config)
    losses = []
    for x in batches(world_size):
        mine = local_rows(x, rank)
        halves = mine.chunk(2) if config.get("accumulate") else [mine]
        for i, half in enumerate(halves):
            model.set_requires_gradient_sync(i == len(halves) - 1)
            loss = model(half).square().mean()
            loss.backward()
        if config.get("frozen"):
            assert model.up.bias.grad is None
        if config.get("clip"):
            # A DTensor total norm over every shard: the global norm, not a shard's.
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            assert norm.full_tensor() > MAX_NORM
        optimizer.step()
        optimizer.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world_size)
    return model, losses


def check_against_reference(rank, world_size, config):
    reference, reference_losses = reference_run(world_size, config)
    model, losses = sharded_run(rank, world_size, config)
    for step, (expected, got) in enumerate(zip(reference_losses, losses)):
        assert abs(expected - got) <= 1e-5 * max(1.0, abs(expected)), (config, step, expected, got)
    for (name, expected), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(
            p.full_tensor(), expected.detach(), rtol=1e-5, atol=1e-5, msg=f"{config} {name}"
        )
    return losses


def configs_body(rank, world_size, configs):
    for config in configs:
        check_against_reference(rank, world_size, config)


def rerun_body(rank, world_size):
    first = sharded_run(rank, world_size, {})[1]
    second = sharded_run(rank, world_size, {})[1]
    assert first == second, (first, second)


class TestParity(unittest.TestCase):
    def test_two_ranks_layouts(self):
        run_ranks(
            2,
            configs_body,
            [
                {},
                {"reshard_after_forward": False},
                {"reshard_after_forward": True},
                {"shard_dim_1": True},
                {"group": True},
                {"comm_fusion": True},
                {"comm_fusion": None},  # the default: fused here (one dtype)
            ],
        )

    def test_two_ranks_training(self):
        run_ranks(
            2,
            configs_body,
            [
                {"accumulate": True},
                {"clip": True},
                {"frozen": True},
                {"optimizer": "fused"},
                {"optimizer": "for-loop"},
                {"recompute": "reentrant"},
                {"recompute": "non_reentrant", "reshard_after_forward": False},
            ],
        )

    def test_four_ranks(self):
        run_ranks(
            4,
            configs_body,
            [{}, {"hsdp": True}, {"reshard_after_forward": 2}, {"hsdp": True, "accumulate": True}],
        )

    def test_rerun_is_bitwise_equal(self):
        run_ranks(2, rerun_body)


if __name__ == "__main__":
    unittest.main()
