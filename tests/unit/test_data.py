"""Built-in data sets: digits split, synthetic sizing, and CIFAR-10 / ImageFolder read from generated on-disk data.

They are plug-ins like any other: ``data.name`` + ``data.args`` (+ ``data.path``) through
``plugins.build_data``, which also checks what the factory returns.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from ray_app.shared import data
from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError
from ray_app.shared.plugins import build_data, validate, validate_local_data


def build_datasets(*overrides):
    """(train, eval, info) of the data plug-in the config names, as a worker builds it."""
    return build_data(load_config(None, list(overrides)))


def as_tensors(ds):
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack(xs), torch.as_tensor(ys)


def test_digits_split_is_deterministic_disjoint_and_normalized():
    train, ev, info = build_datasets()
    assert (len(train), len(ev)) == (1438, 359)  # 1797 images, 20% held out
    assert (info["num_classes"], info["channels"], info["image_size"]) == (10, 1, 8)
    x_tr, y_tr = train.tensors
    x_ev, y_ev = ev.tensors
    assert x_tr.shape == (1438, 1, 8, 8) and x_tr.dtype == torch.float32
    assert x_tr.min() >= -1.0 and x_tr.max() <= 1.0 and x_tr.min() == -1.0 and x_tr.max() == 1.0
    assert set(y_ev.tolist()) == set(range(10))
    # same split every time, whatever the global RNG says
    torch.manual_seed(999)
    train2, ev2, _ = build_datasets("run.seed=7")
    assert torch.equal(ev2.tensors[0], x_ev) and torch.equal(train2.tensors[1], y_tr)
    # disjoint, and together exactly the scikit-learn set
    from sklearn.datasets import load_digits

    raw = torch.tensor(load_digits().images, dtype=torch.float32)
    raw_keys = {tuple(r.flatten().tolist()) for r in (raw / 16.0 - 0.5) / 0.5}
    tr_keys = [tuple(r.flatten().tolist()) for r in x_tr]
    ev_keys = [tuple(r.flatten().tolist()) for r in x_ev]
    assert not set(tr_keys) & set(ev_keys)
    assert set(tr_keys) | set(ev_keys) == raw_keys


def test_synthetic_is_sized_by_config_and_reproducible():
    train, ev, info = build_datasets("data.name=synthetic", "data.args.num_samples=100", "data.args.image_size=16")
    assert (len(train), len(ev)) == (100, 25)
    assert train.tensors[0].shape == (100, 3, 16, 16)
    assert (info["channels"], info["image_size"], info["num_classes"]) == (3, 16, 10)
    again, _, _ = build_datasets("data.name=synthetic", "data.args.num_samples=100", "data.args.image_size=16")
    assert torch.equal(again.tensors[0], train.tensors[0])
    assert not torch.equal(ev.tensors[0][:25], train.tensors[0][:25])


def write_cifar(root, per_batch=6, test=5, seed=0):
    """A tiny CIFAR-10 in the real "python version" layout (pickled dicts, uint8 N x 3072, CHW rows)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, n).tolist()
        batches[name] = (data, labels)
        with open(folder / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"x.png"] * n}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)], b"num_vis": 3072,
                     b"num_cases_per_batch": per_batch}, f)
    return batches


def test_cifar10_reads_the_on_disk_format(tmp_path):
    batches = write_cifar(tmp_path)
    train, ev, info = build_datasets("data.name=cifar10", f"data.path={tmp_path}")
    assert (len(train), len(ev)) == (30, 5)
    assert (info["num_classes"], info["channels"], info["image_size"]) == (10, 3, 32)
    x, y = as_tensors(ev)
    assert x.shape == (5, 3, 32, 32) and x.dtype == torch.float32
    assert y.tolist() == batches["test_batch"][1]
    # pixel (channel 1, row 2, col 3) of test image 4 comes from byte 1024 + 2*32 + 3, normalized
    raw = batches["test_batch"][0][4, 1024 + 2 * 32 + 3] / 255.0
    assert x[4, 1, 2, 3].item() == pytest.approx((raw - 0.4822) / 0.2435, abs=1e-5)
    # train = data_batch_1..5 in order
    _, y_tr = as_tensors(train)
    assert y_tr.tolist() == sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])


def test_cifar10_missing_folder_or_batch_names_data_path(tmp_path):
    with pytest.raises(ConfigError, match="data.path") as exc:
        build_datasets("data.name=cifar10", f"data.path={tmp_path}")
    assert "cifar-10-batches-py" in str(exc.value)
    write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(ConfigError, match="data.path.*data_batch_3"):
        build_datasets("data.name=cifar10", f"data.path={tmp_path}")


def test_cifar10_garbage_file_names_data_path(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="data.path.*test_batch"):
        build_datasets("data.name=cifar10", f"data.path={tmp_path}")


def write_imagefolder(root, classes=("cat", "dog", "emu"), per_class=(3, 2), size=(20, 12)):
    for split, n in zip(("train", "val"), per_class):
        for ci, cls in enumerate(classes):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = np.full((size[1], size[0], 3), 40 * ci + i, dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.png")


def test_imagefolder_reads_pngs(tmp_path):
    write_imagefolder(tmp_path)
    train, ev, info = build_datasets("data.name=imagefolder", f"data.path={tmp_path}", "data.args.image_size=16")
    assert (len(train), len(ev)) == (9, 6)
    assert (info["num_classes"], info["channels"], info["image_size"]) == (3, 3, 16)
    x, y = as_tensors(ev)
    assert x.shape == (6, 3, 16, 16)
    assert y.tolist() == [0, 0, 1, 1, 2, 2]  # classes sorted by folder name
    # a uniform image stays uniform; value 40*2+1 normalized with mean 0.5, std 0.5
    assert torch.allclose(x[5], torch.full_like(x[5], (81 / 255 - 0.5) / 0.5), atol=1e-5)


def test_imagefolder_missing_split_names_data_path(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="data.path") as exc:
        build_datasets("data.name=imagefolder", f"data.path={tmp_path}")
    assert "val/" in str(exc.value)


def test_imagefolder_class_mismatch_is_reported(tmp_path):
    write_imagefolder(tmp_path)
    (tmp_path / "val" / "emu").rename(tmp_path / "val" / "owl")
    with pytest.raises(ConfigError, match="data.path"):
        build_datasets("data.name=imagefolder", f"data.path={tmp_path}")


def test_folder_data_sets_need_a_path():
    for name in ("cifar10", "imagefolder"):
        with pytest.raises(ConfigError, match="data.path"):
            load_config(None, [f"data.name={name}"])


def test_imagefolder_without_images_names_data_path(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "val" / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="data.path"):
        build_datasets("data.name=imagefolder", f"data.path={tmp_path}")


def test_builtin_factories_are_plain_functions_of_their_args():
    """What data.args / data.path become: keyword arguments of the factory (info is a plain dict)."""
    train, ev, info = data.synthetic(num_samples=8, image_size=4)
    assert (len(train), len(ev)) == (8, 2) and train.tensors[0].shape == (8, 3, 4, 4)
    assert info == {"num_classes": 10, "channels": 3, "image_size": 4}
    tr, ev, info = data.digits()
    assert (len(tr), len(ev)) == (1438, 359) and info == {"num_classes": 10, "channels": 1, "image_size": 8}
    # the defaults are the documented ones
    train, ev, info = data.synthetic()
    assert (len(train), len(ev), info["image_size"]) == (2048, 512, 32)


@pytest.mark.parametrize("args", [["data.args.num_samples=0"], ["data.args.image_size=2"],
                                  ["data.args.image_size=2048"]])
def test_synthetic_args_out_of_range_name_data_args(args):
    with pytest.raises(ConfigError, match="config key data.args"):
        build_datasets("data.name=synthetic", *args)


def test_data_path_is_the_factorys_path_argument(tmp_path):
    write_imagefolder(tmp_path)
    # data.args.path and data.path mean the same; data.args wins where both are given
    a = build_datasets("data.name=imagefolder", f"data.path={tmp_path / 'nowhere'}", f"data.args.path={tmp_path}")
    b = build_datasets("data.name=imagefolder", f"data.path={tmp_path}")
    assert len(a[0]) == len(b[0]) == 9


def test_data_folder_is_checked_before_ray_when_the_driver_shares_it(tmp_path):
    """validate_local_data (local Ray): a cifar10/imagefolder data.path laid out wrongly is a one-line
    ConfigError before any worker starts; digits has no folder to check."""
    cfg = load_config(None, ["data.name=cifar10", f"data.path={tmp_path}"])
    validate(cfg)  # the plug-in itself is fine
    with pytest.raises(ConfigError, match="config key data.path.*cifar-10-batches-py"):
        validate_local_data(cfg)
    write_cifar(tmp_path)
    validate_local_data(cfg)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(ConfigError, match="config key data.path.*test_batch"):
        validate_local_data(cfg)
    with pytest.raises(ConfigError, match="config key data.path.*val/"):
        validate_local_data(load_config(None, ["data.name=imagefolder", f"data.path={tmp_path}"]))
    validate_local_data(load_config(None, []))
