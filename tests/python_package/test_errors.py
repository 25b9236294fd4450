"""Bad input to hyperparallel.fully_shard: a Python exception naming the problem and the fix,
and the module left as it was (no parameter sharded, no class changed)."""

import unittest

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import hyperparallel
from models import MLP
from ranks import run_ranks


def expect_error(kind, words, call):
    try:
        call()
    except kind as error:
        for word in words:
            assert word in str(error), (word, str(error))
        return
    raise AssertionError(f"no {kind.__name__} ({words})")


def assert_untouched(model):
    assert type(model) is MLP, type(model)
    for name, p in model.named_parameters():
        assert not isinstance(p, DTensor), name
    assert model.up.weight.shape == (33, 16)


def body(rank, world_size):
    model = MLP()
    expect_error(ValueError, ["nn.Module"], lambda: hyperparallel.fully_shard([]))
    expect_error(
        ValueError,
        ["1D or 2D DeviceMesh", "3 dimensions"],
        lambda: hyperparallel.fully_shard(model, mesh=init_device_mesh("cpu", (1, 1, 2))),
    )
    expect_error(
        ValueError,
        ["reshard_after_forward=3", "divide"],
        lambda: hyperparallel.fully_shard(model, reshard_after_forward=3),
    )
    expect_error(
        ValueError,
        ["error_feedback", "codec"],
        lambda: hyperparallel.fully_shard(model, error_feedback=True),
    )
    expect_error(
        ValueError, ["int8"], lambda: hyperparallel.fully_shard(model, all_gather_codec="int4")
    )
    # The last parameter's placement is wrong: none of the earlier ones may be sharded.
    expect_error(
        ValueError,
        ["shard dim", "head.weight"],
        lambda: hyperparallel.fully_shard(
            model, shard_placement_fn=lambda p: Shard(5) if p.shape == (5, 16) else None
        ),
    )
    assert_untouched(model)

    hyperparallel.fully_shard(model)
    expect_error(ValueError, ["already applied"], lambda: hyperparallel.fully_shard(model))
    expect_error(
        ValueError,
        ["already managed", "submodules first", "tied"],
        lambda: hyperparallel.fully_shard(model.up),
    )
    expect_error(
        ValueError,
        ["prefetch", "fully_shard"],
        lambda: model.set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
    )
    # Still trains after the rejected calls.
    model(torch.randn(2, 16)).sum().backward()
    assert isinstance(model.up.weight.grad, DTensor)
    # A cast of a part that is not fully_shard-ed would leave the core gathering the old
    # shards of the root's parameters.
    model.head.to(torch.float64)
    expect_error(
        RuntimeError,
        ["head.weight", "no longer holds its local shard", "fully_shard-ed module"],
        lambda: model(torch.randn(2, 16)),
    )


class TestErrors(unittest.TestCase):
    def test_bad_input(self):
        run_ranks(2, body)


if __name__ == "__main__":
    unittest.main()
