"""The hand-written torch modules that the tests of mdsl.torch compile. It imports torch: a test imports it
in its body (after the `torch` fixture), so that collecting the suite does not."""
from __future__ import annotations

import torch


class MLP(torch.nn.Module):
    def __init__(self, dim=64, hidden=128, act=torch.nn.GELU):
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(dim, hidden), act(), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class Attention(torch.nn.Module):
    """Multi-head self-attention written out (no fused kernel), with a LayerNorm torch keeps."""

    def __init__(self, dim=64, heads=2):
        super().__init__()
        self.heads, self.norm = heads, torch.nn.LayerNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        weights = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        return x + self.out((weights @ v).transpose(1, 2).reshape(b, s, d))
