"""Built-in models: every one runs on its data shape, takes model.args, torchvision by name, bad names rejected.

Models are plug-ins like any other: ``plugins.build_model(cfg, info)`` calls the one ``model.name`` names
with ``model.args`` plus the entries of the data's ``info`` its signature asks for.
"""

from __future__ import annotations

import pytest
import torch

from ray_app.shared import models, plugins
from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError, PluginError
from ray_app.shared.models import DigitsCNN, count_parameters

DIGITS = {"num_classes": 10, "channels": 1, "image_size": 8}
SMALL_RGB = {"num_classes": 7, "channels": 3, "image_size": 16}
CIFAR = {"num_classes": 10, "channels": 3, "image_size": 32}


def build_model(name: str, info: dict, *overrides: str):
    """The model as a worker builds it for ``model.name=name`` and the data's ``info``."""
    return plugins.build_model(load_config(None, [f"model.name={name}", *overrides]), info)


@pytest.mark.parametrize("name", ["digits_cnn", "mlp"])
@pytest.mark.parametrize("info", [DIGITS, SMALL_RGB], ids=["digits", "rgb16"])
def test_builtin_forward_pass(name, info):
    model = build_model(name, info)
    x = torch.randn(5, info["channels"], info["image_size"], info["image_size"])
    out = model(x)
    assert out.shape == (5, info["num_classes"])
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


def test_model_args_reach_the_builtin_and_info_fills_the_rest():
    """``--set model.args.width=8`` is DigitsCNN(width=8); channels/num_classes come from info."""
    model = build_model("digits_cnn", DIGITS, "model.args.width=8", "model.args.dropout=0.5")
    assert isinstance(model, DigitsCNN)
    assert model.features[0].out_channels == 8 and model.features[2].out_channels == 16
    assert model.classifier[1].p == 0.5 and model.classifier[-1].out_features == 10
    default = build_model("digits_cnn", DIGITS)
    assert default.features[0].out_channels == 32 and count_parameters(default) > count_parameters(model)
    # model.args wins over info: a 3-class head on 10-class data is the user's call
    assert build_model("mlp", DIGITS, "model.args.num_classes=3", "model.args.hidden=16")(
        torch.randn(2, 1, 8, 8)).shape == (2, 3)
    mlp = build_model("mlp", DIGITS, "model.args.hidden=16", "model.args.depth=1")
    assert [m.out_features for m in mlp if isinstance(m, torch.nn.Linear)] == [16, 10]


def test_builtin_model_functions_take_info_by_name():
    assert models.mlp(channels=1, image_size=8, num_classes=4)(torch.randn(3, 1, 8, 8)).shape == (3, 4)
    assert models.wide_mlp(channels=1, image_size=8, num_classes=4)(torch.randn(3, 1, 8, 8)).shape == (3, 4)
    assert DigitsCNN(channels=3, num_classes=5, width=4)(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_resnet18_from_torchvision_with_num_classes():
    import torchvision

    model = build_model("resnet18", SMALL_RGB)
    assert isinstance(model, torchvision.models.ResNet)
    assert model.fc.out_features == 7
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    assert 11_000_000 < count_parameters(model) < 12_000_000


def test_torchvision_model_args_go_to_torchvision():
    model = build_model("resnet18", SMALL_RGB, "model.args.zero_init_residual=true")
    assert all(torch.count_nonzero(block.bn2.weight) == 0 for block in model.layer1)


def test_torchvision_model_on_one_channel_data_names_the_key():
    # caught before Ray from the built-in data set's name ...
    with pytest.raises(ConfigError, match="config key model.name: resnet18 needs 3-channel") as exc:
        plugins.validate(load_config(None, ["model.name=resnet18"]))
    assert "\n" not in str(exc.value)
    # ... and on the worker from the info of any data set (a user's 1-channel data)
    with pytest.raises(PluginError, match="config key model.name: resnet18 needs 3-channel"):
        build_model("resnet18", DIGITS)


@pytest.mark.parametrize("name", ["resnet9000", "not_a_model", ""])
def test_unknown_model_raises_config_error(name):
    with pytest.raises(ConfigError, match="config key model.name") as exc:
        build_model(name, CIFAR)
    with pytest.raises(ConfigError, match="config key model.name"):
        plugins.validate(load_config(None, [f"model.name={name}", "data.name=synthetic"]))
    assert "digits_cnn" in str(exc.value) and "package.module:attribute" in str(exc.value)


@pytest.mark.parametrize("name", [*plugins.BUILTIN["model"], "resnet18", "mobilenet_v3_small"])
def test_known_names_validate(name):
    plugins.validate(load_config(None, [f"model.name={name}", "data.name=synthetic"]))


def test_torchvision_names_read_from_its_sources_match_its_registry():
    import torchvision

    from ray_app.shared.modelnames import is_torchvision_classifier, torchvision_classifiers

    registry = set(torchvision.models.list_models(module=torchvision.models))
    assert torchvision_classifiers() == registry
    assert is_torchvision_classifier("resnet18") and not is_torchvision_classifier("digits_cnn")
    assert not is_torchvision_classifier("fasterrcnn_resnet50_fpn")  # a detection model, not a classifier
