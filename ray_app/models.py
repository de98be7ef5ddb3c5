"""Model factory: small built-in models and torchvision classifiers (random init)."""

from __future__ import annotations

from torch import nn

from ray_app.config import ConfigError
from ray_app.data import DataInfo
from ray_app.modelnames import BUILTIN, validate_model_name  # noqa: F401 -- names checked without torch


class DigitsCNN(nn.Module):
    """Two conv layers and a classifier; ~99% on digits in a few epochs."""

    def __init__(self, channels: int, num_classes: int, image_size: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(64 * 16, 128), nn.ReLU(),
                                        nn.Linear(128, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def _mlp(info: DataInfo, hidden: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = info.channels * info.image_size * info.image_size
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, info.num_classes))
    return nn.Sequential(*layers)


def build_model(name: str, info: DataInfo) -> nn.Module:
    """``model.name`` -> an ``nn.Module`` with random init (seed before calling)."""
    if name == "digits_cnn":
        return DigitsCNN(info.channels, info.num_classes, info.image_size)
    if name == "mlp":
        return _mlp(info, hidden=256, depth=2)
    if name == "wide_mlp":  # ~25M parameters at 32x32x3: all-reduce dominates (communication-bound bench)
        return _mlp(info, hidden=3072, depth=3)
    try:
        import torchvision
    except Exception as exc:  # pragma: no cover
        raise ConfigError(f"config key model.name={name}: needs torchvision ({exc}); use digits_cnn, mlp or wide_mlp") from None
    if name not in torchvision.models.list_models(module=torchvision.models):
        raise ConfigError(f"config key model.name: unknown model {name!r}; use {', '.join(BUILTIN)} "
                          "or a torchvision classifier such as resnet18")
    if info.channels != 3:  # checked before building: a large model takes seconds to initialize
        raise ConfigError(f"config key model.name={name}: torchvision models need 3-channel images; "
                          "use data.name=synthetic/cifar10/imagefolder or model.name=digits_cnn")
    return torchvision.models.get_model(name, weights=None, num_classes=info.num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
