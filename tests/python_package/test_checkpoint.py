"""torch.distributed.checkpoint on hyperparallel's DTensor parameters and optimizer state:
get_state_dict / set_state_dict and dcp.save / dcp.load round trip, so that a resumed run
continues bitwise as the uninterrupted one."""

import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hyperparallel
from models import MLP, batches, local_rows
from ranks import run_ranks


def new_run():
    torch.manual_seed(0)
    model = MLP()
    for layer in (model.up, model.down):
        hyperparallel.fully_shard(layer)
    hyperparallel.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optimizer, rank, data):
    losses = []
    for x in data:
        loss = model(local_rows(x, rank)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def body(rank, world_size, directory):
    data = batches(world_size, steps=6)
    model, optimizer = new_run()
    uninterrupted = train(model, optimizer, rank, data)

    model, optimizer = new_run()
    train(model, optimizer, rank, data[:3])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory)
    del model, optimizer
    dist.barrier()

    model, optimizer = new_run()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    resumed = train(model, optimizer, rank, data[3:])
    assert resumed == uninterrupted[3:], (resumed, uninterrupted[3:])


class TestCheckpoint(unittest.TestCase):
    def test_resume_is_bitwise(self):
        with tempfile.TemporaryDirectory() as directory:
            run_ranks(2, body, directory)


if __name__ == "__main__":
    unittest.main()
