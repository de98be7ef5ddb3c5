"""Model factory: every built-in runs on its data shape, torchvision by name, bad names rejected."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ray_app.config import ConfigError
from ray_app.data import DataInfo
from ray_app.models import BUILTIN, build_model, count_parameters, validate_model_name

DIGITS = DataInfo(num_classes=10, channels=1, image_size=8)
SMALL_RGB = DataInfo(num_classes=7, channels=3, image_size=16)
CIFAR = DataInfo(num_classes=10, channels=3, image_size=32)


@pytest.mark.parametrize("name", ["digits_cnn", "mlp"])
@pytest.mark.parametrize("info", [DIGITS, SMALL_RGB], ids=["digits", "rgb16"])
def test_builtin_forward_pass(name, info):
    model = build_model(name, info)
    x = torch.randn(5, info.channels, info.image_size, info.image_size)
    out = model(x)
    assert out.shape == (5, info.num_classes)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_wide_mlp_is_about_25m_parameters_and_runs():
    model = build_model("wide_mlp", CIFAR)
    assert 20_000_000 <= count_parameters(model) <= 30_000_000
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_same_seed_same_init():
    torch.manual_seed(4)
    a = build_model("digits_cnn", DIGITS)
    torch.manual_seed(4)
    b = build_model("digits_cnn", DIGITS)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_resnet18_from_torchvision_with_num_classes():
    import torchvision

    model = build_model("resnet18", SMALL_RGB)
    assert isinstance(model, torchvision.models.ResNet)
    assert model.fc.out_features == 7
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    assert 11_000_000 < count_parameters(model) < 12_000_000


def test_torchvision_model_on_one_channel_data_names_the_key():
    with pytest.raises(ConfigError, match="model.name=resnet18.*3-channel"):
        build_model("resnet18", DIGITS)


@pytest.mark.parametrize("name", ["resnet9000", "not_a_model", ""])
def test_unknown_model_raises_config_error(name):
    with pytest.raises(ConfigError, match="model.name"):
        build_model(name, CIFAR)
    with pytest.raises(ConfigError, match="model.name"):
        validate_model_name(name)


@pytest.mark.parametrize("name", [*BUILTIN, "resnet18", "mobilenet_v3_small"])
def test_known_names_validate(name):
    validate_model_name(name)


def test_torchvision_names_read_from_its_sources_match_its_registry():
    import torchvision

    from ray_app.modelnames import torchvision_classifiers

    assert torchvision_classifiers() == set(torchvision.models.list_models(module=torchvision.models))


def test_model_names_are_checked_without_importing_torch():
    code = ("import sys; from ray_app.modelnames import validate_model_name; validate_model_name('resnet18'); "
            "validate_model_name('digits_cnn'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
