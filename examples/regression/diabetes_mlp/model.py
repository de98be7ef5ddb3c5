"""A plain multi-layer perceptron for tabular regression."""

import torch
import torch.nn as nn


class MLP(nn.Module):
    """`depth` hidden layers of `hidden` units with ReLU; `forward(x [B, in]) -> [B, out]`.

    `in_features` comes from the data's `info` (the kit passes it because it
    is a parameter here and not in `model.args`).
    """

    def __init__(self, in_features: int, hidden: int = 64, depth: int = 2, out_features: int = 1):
        super().__init__()
        layers, width = [], in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
