"""Data sets: digits (ships with scikit-learn), synthetic, cifar10, imagefolder.

Every data set is returned as (train, eval, DataInfo). Nothing is downloaded:
cifar10 and imagefolder read a local folder in their standard on-disk format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from ray_app.config import ConfigError, DataSection

DIGITS_SPLIT_SEED = 1234  # fixed, independent of run.seed: the eval set never changes
DIGITS_EVAL_FRACTION = 0.2


@dataclass(frozen=True)
class DataInfo:
    num_classes: int
    channels: int
    image_size: int


def _digits():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # 1797 x 1 x 8 x 8
    x = (x - 0.5) / 0.5
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
    n_eval = int(len(y) * DIGITS_EVAL_FRACTION)
    ev, tr = order[:n_eval], order[n_eval:]
    return TensorDataset(x[tr], y[tr]), TensorDataset(x[ev], y[ev]), DataInfo(10, 1, 8)


def synthetic_tensors(num_samples: int, image_size: int, seed: int, num_classes: int = 10):
    """Random images whose label is learnable (class-dependent mean), made from a seed."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    x = torch.randn(num_samples, 3, image_size, image_size, generator=g)
    x += (y.float() / num_classes - 0.5).view(-1, 1, 1, 1)
    return x, y


def _synthetic(cfg: DataSection):
    x, y = synthetic_tensors(cfg.num_samples, cfg.image_size, seed=1)
    xe, ye = synthetic_tensors(max(cfg.num_samples // 4, 1), cfg.image_size, seed=2)
    return TensorDataset(x, y), TensorDataset(xe, ye), DataInfo(10, 3, cfg.image_size)


def _torchvision(name: str):
    try:
        import torchvision  # noqa: F401  (lazy: the CPU image ships without it)
        from torchvision import datasets, transforms
    except Exception as exc:  # pragma: no cover - depends on the install
        raise ConfigError(f"config key data.name={name}: needs torchvision, which is not importable ({exc}); "
                          "install torchvision or use data.name=digits/synthetic") from None
    return datasets, transforms


def _cifar10(cfg: DataSection):
    root = Path(cfg.path)
    if not (root / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"config key data.path: {root} has no cifar-10-batches-py/ folder; "
                          "download CIFAR-10 (python version) and extract it there")
    datasets, transforms = _torchvision("cifar10")
    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    tf = transforms.Compose([transforms.ToTensor(), norm])
    train = datasets.CIFAR10(str(root), train=True, transform=tf, download=False)
    test = datasets.CIFAR10(str(root), train=False, transform=tf, download=False)
    return train, test, DataInfo(10, 3, 32)


def _imagefolder(cfg: DataSection):
    root = Path(cfg.path)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ConfigError(f"config key data.path: {root} has no {split}/ folder; "
                              "lay the images out as train/<class>/*.png and val/<class>/*.png")
    datasets, transforms = _torchvision("imagefolder")
    tf = transforms.Compose([
        transforms.Resize((cfg.image_size, cfg.image_size)),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    train = datasets.ImageFolder(str(root / "train"), transform=tf)
    val = datasets.ImageFolder(str(root / "val"), transform=tf)
    if train.classes != val.classes:
        raise ConfigError(f"config key data.path: {root}/train and {root}/val have different class folders")
    return train, val, DataInfo(len(train.classes), 3, cfg.image_size)


def build_datasets(cfg: DataSection) -> tuple[Dataset, Dataset, DataInfo]:
    """The train and eval sets named by ``data.name``."""
    builders = {"digits": lambda c: _digits(), "synthetic": _synthetic, "cifar10": _cifar10, "imagefolder": _imagefolder}
    return builders[cfg.name](cfg)
