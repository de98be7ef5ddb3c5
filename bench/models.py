"""Model plug-ins of the bench (``model.name: bench.models:<name>``), built alike by the kit and the twin.

``vit``: a small vision transformer for case (m), the speed switches: image patches as tokens through a
ModuleList of pre-norm transformer blocks, a mean over the tokens, a linear head. Its blocks are where
activation checkpointing and compile apply (the outermost ModuleList: no ``train.fsdp_units`` needed), and
most of what autograd keeps for backward is inside them (each block's attention and 4x-wide MLP), so full
activation checkpointing shows in a rank's peak memory even on a CPU. Plain torch (no BatchNorm: training and
evaluation compute the same way; ``F.scaled_dot_product_attention``, which ``torch.compile`` takes whole).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self, num_classes: int, channels: int, image_size: int, patch: int, dim: int, depth: int,
                 heads: int):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"model.args.patch: {patch} does not divide the images' size {image_size}")
        self.patch = patch
        self.embed = nn.Linear(channels * patch * patch, dim)
        self.position = nn.Parameter(torch.zeros(1, (image_size // patch) ** 2, dim))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch
        tokens = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)  # [B, patches, C*p*p]
        x = self.embed(tokens) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def vit(num_classes: int = 10, channels: int = 3, image_size: int = 32, patch: int = 4, dim: int = 128,
        depth: int = 6, heads: int = 4) -> ViT:
    """``model.name: bench.models:vit``; the data's info gives ``num_classes``, ``channels`` and ``image_size``."""
    return ViT(num_classes, channels, image_size, patch, dim, depth, heads)
