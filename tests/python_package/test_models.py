"""Larger Python models under hyperparallel.fully_shard against single-process PyTorch on
the global batch (fp32, 1e-5), 2 ranks: the project's decoder (models/transformer.py: tied
output projection, RMSNorm, causal attention, SwiGLU) with each block sharded, and a small
ViT built from torch.nn's own layers (Conv2d patches, TransformerEncoderLayer with
MultiheadAttention, LayerNorm)."""

import os
import sys
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hyperparallel
from ranks import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models"))
from transformer import Transformer  # noqa: E402

STEPS = 3
PER_RANK = 2
VOCAB, SEQ = 64, 8


class ViT(nn.Module):
    def __init__(self, image=8, patch=4, dim=24, heads=2, layers=2, classes=5):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.position = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def blocks(self):
        return list(self.layers)

    def forward(self, images):
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.position
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


def new_model(kind):
    torch.manual_seed(0)
    if kind == "transformer":
        return Transformer(VOCAB, 32, 4, 2, 64, SEQ)
    return ViT()


def data(kind, world_size):
    g = torch.Generator().manual_seed(3)
    rows = world_size * PER_RANK
    if kind == "transformer":
        return [torch.randint(VOCAB, (rows, SEQ + 1), generator=g) for _ in range(STEPS)]
    return [
        (torch.randn(rows, 3, 8, 8, generator=g), torch.randint(5, (rows,), generator=g))
        for _ in range(STEPS)
    ]


def loss_of(kind, model, batch):
    if kind == "transformer":
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def rows(kind, batch, rank):
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return batch[part] if kind == "transformer" else (batch[0][part], batch[1][part])


def train(kind, model, batches, rank=None):
    # SGD, not Adam: attention's key bias gets a gradient that is rounding noise (softmax
    # ignores a shift shared by all keys), which Adam would scale up to a full step.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in batches:
        loss = loss_of(kind, model, batch if rank is None else rows(kind, batch, rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def body(rank, world_size):
    for kind in ("transformer", "vit"):
        batches = data(kind, world_size)
        reference = new_model(kind)
        expected = train(kind, reference, batches)
        model = new_model(kind)
        for block in model.blocks():
            hyperparallel.fully_shard(block)
        hyperparallel.fully_shard(model)
        got = train(kind, model, batches, rank)
        for step, (a, b) in enumerate(zip(expected, got)):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (kind, step, a, b)
        for (name, p_ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(
                p.full_tensor(), p_ref.detach(), rtol=1e-5, atol=1e-5, msg=f"{kind} {name}"
            )


class TestModels(unittest.TestCase):
    def test_two_ranks(self):
        run_ranks(2, body)


if __name__ == "__main__":
    unittest.main()
