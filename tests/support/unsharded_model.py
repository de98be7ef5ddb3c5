"""Model plug-ins with what FSDP does not shard: BatchNorm's running statistics (buffers each rank moves by its
own batch in training mode) and scalar parameters; blocks holding BatchNorm (for activation checkpointing)."""

import torch
from torch import nn


def bn_net(channels: int, image_size: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size * image_size, 32), nn.BatchNorm1d(32),
                         nn.ReLU(), nn.Linear(32, num_classes))


class _Scaled(nn.Module):
    """A block with a learned 0-d gain (ReZero's alpha as a scalar)."""

    def __init__(self, width: int):
        super().__init__()
        self.fc, self.gain = nn.Linear(width, width), nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x + self.gain * torch.relu(self.fc(x))


class ScalarNet(nn.Module):
    """Scalar (0-d) parameters, which FSDP cannot shard: a gain inside each block (a unit) and a temperature at
    the root."""

    def __init__(self, channels: int, image_size: int, num_classes: int, width: int = 32):
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size * image_size, width))
        self.blocks = nn.ModuleList([_Scaled(width) for _ in range(2)])
        self.head = nn.Linear(width, num_classes)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) / self.temperature


class _NormedBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.BatchNorm1d(width)

    def forward(self, x):
        return x + torch.relu(self.norm(self.fc(x)))


class BlockClassifier(nn.Module):
    """A classifier of ``blocks`` blocks of ``block`` (a ModuleList, what activation checkpointing and compile
    wrap) between a flattening stem and a head."""

    def __init__(self, channels: int, image_size: int, num_classes: int, block: type, blocks: int, width: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size * image_size, width))
        self.blocks = nn.ModuleList([block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BlocksWithBatchNorm(BlockClassifier):
    """A classifier whose blocks (a ModuleList) hold BatchNorm: running statistics inside what activation
    checkpointing runs twice."""

    def __init__(self, channels: int, image_size: int, num_classes: int, width: int = 32):
        super().__init__(channels, image_size, num_classes, _NormedBlock, 3, width)
