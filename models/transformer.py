"""The PyTorch twin of models/transformer.h (its dense decoder, without tensor, context or
expert parallelism): token + learned position embeddings, pre-norm blocks (RMSNorm ->
causal multi-head attention -> residual, RMSNorm -> SwiGLU MLP -> residual), a final
RMSNorm and an output projection tied to the token embedding.

Parameter names are those of the C++ model ("layers.0.attn.wq.weight",
"tok_embeddings.weight", ...) and the forward runs the same operators in the same order,
so a state dict moves between the two and gives the same logits.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()  # normalized in fp32 so that bf16 activations keep their scale
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]

        def split(y):
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.head_dim**0.5)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, -1, dtype=torch.float).to(v.dtype)
        return self.wo(torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1))


class SwiGlu(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    def __init__(self, dim, heads, ffn):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGlu(dim, ffn)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab, dim, heads, layers, ffn, max_seq):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(DecoderBlock(dim, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2 style, as init_decoder_weights: N(0, 0.02), residual output projections
        scaled down by depth, norm weights 1."""
        layers = len(self.layers)
        residual_std = 0.02 / (2.0 * max(layers, 1)) ** 0.5
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                out = name.endswith("attn.wo.weight") or name.endswith("mlp.w2.weight")
                p.normal_(0.0, residual_std if out else 0.02)
            else:
                p.fill_(1.0)

    def blocks(self):
        return list(self.layers)

    def forward(self, tokens):
        """tokens [B, T] int64, T <= max_seq -> logits [B, T, vocab]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return F.linear(self.norm(h), self.tok_embeddings.weight)  # tied output
