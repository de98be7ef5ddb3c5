"""Built-in models, plug-ins like any other (``model.name: digits_cnn`` = ``ray_app.shared.models:DigitsCNN``).

Each takes what it needs from the data's info by parameter name (``channels``, ``num_classes``,
``image_size``) and the rest from ``model.args``. torchvision classifiers (``resnet18``, ...) are
built with random weights.
"""

from __future__ import annotations

from torch import nn


class DigitsCNN(nn.Module):
    """Two conv layers and a classifier; ~99% on digits in a few epochs. Any image size (adaptive pooling)."""

    def __init__(self, channels: int, num_classes: int, width: int = 32, dropout: float = 0.1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * 16, 128), nn.ReLU(),
                                        nn.Linear(128, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def mlp(channels: int, image_size: int, num_classes: int, hidden: int = 256, depth: int = 2) -> nn.Module:
    """Flatten, ``depth`` hidden layers of ``hidden`` units with ReLU, a linear classifier."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = channels * image_size * image_size
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def wide_mlp(channels: int, image_size: int, num_classes: int) -> nn.Module:
    """~25M parameters at 32x32x3: all-reduce dominates (the communication-bound benchmark)."""
    return mlp(channels, image_size, num_classes, hidden=3072, depth=3)


def torchvision_classifier(name: str, num_classes: int, channels: int = 3, **kwargs) -> nn.Module:
    """A torchvision classifier by name (``resnet18``, ...), random init; other args go to torchvision."""
    import torchvision

    from ray_app.shared.errors import PluginError

    if channels != 3:
        raise PluginError(f"config key model.name: {name} needs 3-channel images and the data has {channels}; "
                          "use model.name=digits_cnn or mlp")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
