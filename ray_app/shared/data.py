"""Built-in data sets, plug-ins like any other (``data.name: digits`` = ``ray_app.shared.data:digits``).

Each is a factory returning ``(train, eval, info)``; ``info`` holds ``num_classes``,
``channels`` and ``image_size``, which the built-in models take by name. Nothing is
downloaded: cifar10 and imagefolder read a local folder in their standard on-disk format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from ray_app.shared.errors import ConfigError, first_line
from ray_app.shared.plugins import check_builtin_data_folder

DIGITS_SPLIT_SEED = 1234  # fixed, independent of run.seed: the eval set never changes
DIGITS_EVAL_FRACTION = 0.2


def image_info(num_classes: int, channels: int, image_size: int) -> dict:
    return {"num_classes": num_classes, "channels": channels, "image_size": image_size}


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 digits scikit-learn ships, read from its data file.

    Reading ``sklearn/datasets/data/digits.csv.gz`` directly gives the same
    arrays as ``sklearn.datasets.load_digits()`` without importing scikit-learn
    (about a second of every worker's start-up).
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = Path(base) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # layout changed: fall back to the public API

    bunch = load_digits()
    return bunch.images, bunch.target


def digits():
    """The 1,797 8x8 handwritten digits scikit-learn ships: 1,438 train / 359 eval, split by a fixed seed."""
    images, target = load_digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0  # 1797 x 1 x 8 x 8
    x = (x - 0.5) / 0.5
    y = torch.tensor(target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
    n_eval = int(len(y) * DIGITS_EVAL_FRACTION)
    ev, tr = order[:n_eval], order[n_eval:]
    return TensorDataset(x[tr], y[tr]), TensorDataset(x[ev], y[ev]), image_info(10, 1, 8)


def synthetic_tensors(num_samples: int, image_size: int, seed: int, num_classes: int = 10):
    """Random images whose label is learnable (class-dependent mean), made from a seed."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    x = torch.randn(num_samples, 3, image_size, image_size, generator=g)
    x += (y.float() / num_classes - 0.5).view(-1, 1, 1, 1)
    return x, y


def synthetic(num_samples: int = 2048, image_size: int = 32):
    """Random 3-channel images with learnable labels, for benchmarks; the eval set is a quarter the size."""
    if num_samples < 1 or not 4 <= image_size <= 1024:
        raise ConfigError("config key data.args: synthetic needs num_samples >= 1 and 4 <= image_size <= 1024")
    x, y = synthetic_tensors(num_samples, image_size, seed=1)
    xe, ye = synthetic_tensors(max(num_samples // 4, 1), image_size, seed=2)
    return TensorDataset(x, y), TensorDataset(xe, ye), image_info(10, 3, image_size)


def _torchvision(name: str):
    try:
        import torchvision  # noqa: F401  (lazy: the CPU image ships without it)
        from torchvision import datasets, transforms
    except Exception as exc:  # pragma: no cover - depends on the install
        raise ConfigError(f"config key data.name={name}: needs torchvision, which is not importable ({exc}); "
                          "install torchvision or use data.name=digits/synthetic") from None
    return datasets, transforms


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))


class CifarBatches(Dataset):
    """CIFAR-10 "python version" batches, kept as uint8 and normalized per item (a quarter of the memory).

    Read directly rather than through torchvision's CIFAR10, whose md5 check
    rejects anything but the exact published files (re-packed or subset copies).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return (self.images[i].float() / 255.0 - self.mean) / self.std, self.labels[i]


def _read_cifar_batches(folder: Path, names) -> CifarBatches:
    import pickle

    images, labels = [], []
    for name in names:
        f = folder / name
        try:
            with open(f, "rb") as fh:
                batch = pickle.load(fh, encoding="latin1")  # the format's own encoding (it is a pickle)
            data = np.asarray(batch.get("data", batch.get(b"data")), dtype=np.uint8)
            target = batch.get("labels", batch.get(b"labels"))
            images.append(torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()))
            labels.append(torch.tensor(list(target), dtype=torch.long))
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"config key data.path: {f} is not a CIFAR-10 python batch ({type(exc).__name__}); "
                              "use the python version of CIFAR-10") from None
    return CifarBatches(torch.cat(images), torch.cat(labels))


def cifar10(path: str):
    """CIFAR-10's python version under ``path/cifar-10-batches-py/`` (50,000 train / 10,000 eval)."""
    check_builtin_data_folder("cifar10", path)
    folder = Path(path) / "cifar-10-batches-py"
    return (_read_cifar_batches(folder, CIFAR_TRAIN_FILES), _read_cifar_batches(folder, ("test_batch",)),
            image_info(10, 3, 32))


def imagefolder(path: str, image_size: int = 32):
    """Images under ``path/train/<class>/`` and ``path/val/<class>/``, resized to ``image_size``."""
    check_builtin_data_folder("imagefolder", path)
    root = Path(path)
    datasets, transforms = _torchvision("imagefolder")
    tf = transforms.Compose([
        transforms.Resize((image_size, image_size)),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    try:
        train = datasets.ImageFolder(str(root / "train"), transform=tf)
        val = datasets.ImageFolder(str(root / "val"), transform=tf)
    except (FileNotFoundError, OSError) as exc:  # no class folders, or a class with no images
        first = first_line(exc)
        raise ConfigError(f"config key data.path: {root}: {first}; "
                          "lay the images out as train/<class>/*.png and val/<class>/*.png") from None
    if train.classes != val.classes:
        raise ConfigError(f"config key data.path: {root}/train and {root}/val have different class folders")
    return train, val, image_info(len(train.classes), 3, image_size)
