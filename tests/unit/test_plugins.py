"""Plug-ins: the user's own data, model and task named in the config, checked before Ray and on the workers.

Every user plug-in here is a small module this test writes into its tmp_path (a unique module name per
test, removed from sys.modules afterwards). Also: the built-ins' signatures read from source, the errors
raised in user code (UserCodeError), the failure policy that tells a bug from a fault, and the built-in tasks.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import pickle
import subprocess
import sys
import textwrap
import traceback
import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ray_app.shared import plugins, tasks
from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError, PluginError, UserCodeError
from ray_app.shared.plugins import BUILTIN, build_data, build_model, build_task, validate


def cfg(*overrides: str):
    return load_config(None, list(overrides))


@pytest.fixture
def plug(tmp_path, monkeypatch):
    """``plug(source, package=False) -> module name``: a user module on sys.path, unique to this call.

    With ``package=True`` the module is ``<pkg>.mod`` inside a package of its own (``<pkg>/__init__.py``).
    """
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def write(source: str, package: bool = False) -> str:
        top = f"userplug_{uuid.uuid4().hex[:10]}"
        made.append(top)
        if package:
            (tmp_path / top).mkdir()
            (tmp_path / top / "__init__.py").write_text("")
            path, name = tmp_path / top / "mod.py", f"{top}.mod"
        else:
            path, name = tmp_path / f"{top}.py", top
        path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        return name

    yield write
    for mod in list(sys.modules):
        if mod.split(".")[0] in made:
            del sys.modules[mod]


def config_error(*overrides: str) -> str:
    """The message of the ConfigError plugins.validate raises for the config; asserted to be one line."""
    with pytest.raises(ConfigError) as exc:
        validate(cfg(*overrides))
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("config key "), msg
    return msg


MODEL = """
    import torch
    from torch import nn

    CONST = 3

    class Net(nn.Module):
        def __init__(self, num_classes, hidden=4, channels=1, image_size=8):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size * image_size, hidden),
                                      nn.ReLU(), nn.Linear(hidden, num_classes))

        def forward(self, x):
            return self.body(x)

    def helper():
        return None
"""


# ---------------------------------------------------------------- validate: one line naming the key

def test_a_valid_user_plugin_set_validates(plug):
    data = plug("""
        import torch
        from torch.utils.data import TensorDataset

        def build(root, n_eval=4):
            return TensorDataset(torch.zeros(8, 2)), TensorDataset(torch.zeros(n_eval, 2)), {"num_classes": 2}
    """)
    model = plug(MODEL)
    task = plug("""
        class MyTask:
            def __init__(self, weight=1.0):
                self.weight = weight

            def loss(self, model, batch):
                return model(batch[0]).sum(), 1

            def evaluate(self, model, batch):
                return {}
    """)
    validate(cfg(f"data.name={data}:build", "data.args.root=/data", "data.args.n_eval=2", f"model.name={model}:Net",
                 "model.args.hidden=8", f"task.name={task}:MyTask", "task.args.weight=0.5"))


def test_module_that_cannot_be_imported_names_model_name():
    msg = config_error("model.name=no_such_userplug_pkg.model:Net")
    assert msg.startswith("config key model.name: cannot import 'no_such_userplug_pkg.model'")
    assert "PYTHONPATH" in msg


def test_submodule_that_does_not_exist_names_model_name(plug):
    pkg = plug("X = 1\n", package=True).split(".")[0]
    assert "cannot import" in config_error(f"model.name={pkg}.nope:Net")


def test_missing_attribute_names_what_the_module_has(plug):
    name = plug(MODEL)
    msg = config_error(f"model.name={name}:Nett")
    assert msg.startswith(f"config key model.name: module {name} has no attribute 'Nett'; it has Net, helper")
    assert "torch" not in msg.split("it has")[1] and "CONST" not in msg  # its own callables only


def test_attribute_that_is_not_callable(plug):
    name = plug(MODEL)
    msg = config_error(f"model.name={name}:CONST")
    assert f"{name}:CONST is a int, not a class or function" in msg


def test_unknown_argument_names_the_arg_and_lists_what_it_takes(plug):
    msg = config_error("model.args.widht=3")
    assert msg.startswith("config key model.args.widht: digits_cnn takes no argument 'widht'")
    assert msg.endswith("it takes channels, num_classes, width, dropout")
    name = plug(MODEL)
    msg = config_error(f"model.name={name}:Net", "model.args.hiden=3")
    assert msg.startswith("config key model.args.hiden:") and "num_classes, hidden, channels, image_size" in msg
    assert config_error("task.args.smoothing=0.1").startswith("config key task.args.smoothing: classification")
    assert config_error("data.args.num_samples=10").startswith("config key data.args.num_samples: digits takes")


def test_a_plugin_with_kwargs_takes_any_argument(plug):
    name = plug("""
        def Net(**kwargs):
            return kwargs
    """)
    validate(cfg(f"model.name={name}:Net", "model.args.anything=1"))


def test_data_factory_missing_a_required_argument(plug):
    name = plug("""
        def build(root, n_eval=10):
            raise AssertionError("not called by validate")

        def from_folder(path):
            raise AssertionError("not called by validate")
    """)
    msg = config_error(f"data.name={name}:build")
    assert msg.startswith("config key data.args.root:") and msg.endswith("needs root; set data.args.root")
    assert config_error(f"data.name={name}:from_folder").startswith("config key data.path:")
    validate(cfg(f"data.name={name}:from_folder", "data.path=/data"))  # data.path is its path argument
    validate(cfg(f"data.name={name}:from_folder", "data.args.path=/data"))


def test_data_path_given_to_a_factory_that_takes_no_path(plug):
    assert config_error("data.path=/data").startswith("config key data.path: digits takes no path argument")
    name = plug("""
        def build(root):
            return None
    """)
    assert config_error(f"data.name={name}:build", "data.args.root=/r", "data.path=/data").startswith(
        "config key data.path:")


def test_task_class_without_evaluate(plug):
    name = plug("""
        class HalfTask:
            def loss(self, model, batch):
                return 0.0, 1
    """)
    msg = config_error(f"task.name={name}:HalfTask")
    assert msg.startswith(f"config key task.name: {name}:HalfTask has no evaluate(model, batch) method")


@pytest.mark.parametrize("path", ["acme-x.model:Net", "acme:", ":Net", "acme..model:Net", "acme:Net-2", "a b:C"])
def test_malformed_import_path(path):
    msg = config_error(f"model.name={path}")
    assert msg.startswith("config key model.name:") and "not an import path" in msg and "package.module:attribute" in msg


def test_user_module_with_a_syntax_error_is_one_line(plug):
    name = plug("""
        class Net:
            def __init__(self:
                pass
    """)
    msg = config_error(f"model.name={name}:Net")
    assert msg.startswith(f"config key model.name: importing {name} failed: SyntaxError:")
    assert f"({name}.py, line 3)" in msg


def test_user_module_that_raises_at_import_is_one_line(plug):
    name = plug("""
        raise RuntimeError("needs a GPU\\nand more lines")
    """)
    assert config_error(f"task.name={name}:T").endswith(f"importing {name} failed: RuntimeError: needs a GPU")


def test_missing_dependency_of_a_user_module_is_not_a_missing_module(plug):
    name = plug("import userplug\n")  # `userplug` is a prefix of every module name plug() writes
    msg = config_error(f"model.name={name}:Net")
    assert "importing" in msg and "No module named 'userplug'" in msg


def test_missing_dependency_of_a_user_module_names_it(plug):
    name = plug("import no_such_dependency_zz\n")
    msg = config_error(f"model.name={name}:Net")
    assert msg.startswith(f"config key model.name: importing {name} failed: ModuleNotFoundError")
    assert "no_such_dependency_zz" in msg


def test_torchvision_model_on_one_channel_data():
    msg = config_error("model.name=resnet18")  # data.name=digits: 1 channel
    assert msg.startswith("config key model.name: resnet18 needs 3-channel images") and "digits" in msg
    validate(cfg("model.name=resnet18", "data.name=synthetic"))


@pytest.mark.parametrize("override, key", [("data.name=mnist", "data.name"), ("model.name=resnet9000", "model.name"),
                                           ("task.name=ranking", "task.name")])
def test_unknown_builtin_name(override, key):
    msg = config_error(override)
    assert msg.startswith(f"config key {key}: unknown") and "package.module:attribute" in msg
    if key == "data.name":
        assert "digits, synthetic, cifar10, imagefolder" in msg


def test_builtins_validate_without_importing_torch():
    code = ("import sys; from ray_app.shared.config import load_config; from ray_app import plugins; "
            "plugins.validate(load_config(None, [])); "
            "plugins.validate(load_config(None, ['data.name=synthetic', 'model.name=resnet18', 'model.args.dropout=0.1',"
            " 'task.name=regression'])); "
            "plugins.validate(load_config(None, ['model.name=wide_mlp', 'task.name=language_model'])); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- built-ins read from source

@pytest.mark.parametrize("kind, name", [pytest.param(k, n)
                                        for k in plugins.KINDS for n in BUILTIN[k]])
def test_builtin_params_read_from_source_match_the_real_signature(kind, name):
    from_source = plugins.params(kind, name)
    real = plugins.Params.of(plugins.resolve(kind, name))
    assert (from_source.names, from_source.required, from_source.var_kw) == (real.names, real.required, real.var_kw)
    assert from_source.names == [p for p in inspect.signature(plugins.resolve(kind, name)).parameters
                                 if p not in ("args", "kwargs")]


def test_regression_takes_the_batch_keys():
    validate(cfg("task.name=regression", "task.args.input_key=features"))


def test_torchvision_params_match_the_real_function():
    from ray_app.shared.models import torchvision_classifier

    fixed = plugins.params("model", "resnet18")
    real = plugins.Params.of(functools.partial(torchvision_classifier, "resnet18"))
    assert (fixed.names, fixed.required, fixed.var_kw) == (real.names, real.required, real.var_kw)


def _tiny_cifar(root):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({b"labels": [1], b"data": np.zeros((1, 3072), dtype=np.uint8)}, f)


def _tiny_imagefolder(root):
    from PIL import Image

    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(root / split / "a" / "0.png")


def test_builtin_data_channels_are_those_of_the_real_data_sets(tmp_path):
    from ray_app.shared import data

    # shards: its manifest's info; text: tokens, no image channels
    assert set(plugins.BUILTIN_DATA_CHANNELS) == set(BUILTIN["data"]) - {"shards", "text"}
    _tiny_cifar(tmp_path / "c")
    _tiny_imagefolder(tmp_path / "i")
    real = {"digits": data.digits(), "synthetic": data.synthetic(num_samples=4, image_size=4),
            "cifar10": data.cifar10(str(tmp_path / "c")), "imagefolder": data.imagefolder(str(tmp_path / "i"))}
    for name, (train, _, info) in real.items():
        assert info["channels"] == plugins.BUILTIN_DATA_CHANNELS[name] == train[0][0].shape[0], name


# ---------------------------------------------------------------- build_data: the contract on the worker

DATA = """
    import torch
    from torch.utils.data import Dataset, IterableDataset, TensorDataset

    def ds(n):
        return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.zeros(n, dtype=torch.long))

    def single():
        return ds(4)

    def four():
        return ds(4), ds(2), {}, "extra"

    def pair(path="", n_eval=2):
        return ds(4), ds(n_eval)

    def triple():
        return ds(4), ds(2), {"num_classes": 2, "vocab_size": 7}

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    def stream():
        return Stream(), ds(2)

    class LenOnly:
        def __len__(self):
            return 3

    def len_only():
        return ds(4), LenOnly()

    def empty_eval():
        return ds(4), ds(0)

    def bad_info():
        return ds(4), ds(2), ["num_classes", 2]

    def seen_path(path, n_eval=1):
        return ds(4), ds(n_eval), {"path": path}
"""


@pytest.mark.parametrize("factory, fragment", [
    ("single", "returned a TensorDataset; it must return (train, eval) or (train, eval, info)"),
    ("four", "returned a tuple of 4 items"),
    ("stream", "the train set of {name}:stream (Stream) has no __len__"),
    ("len_only", "the eval set of {name}:len_only (LenOnly) has no __getitem__"),
    ("empty_eval", "the eval set of {name}:empty_eval is empty"),
    ("bad_info", "returned info of type list; the third item must be a dict"),
])
def test_build_data_checks_what_the_factory_returns(plug, factory, fragment):
    name = plug(DATA)
    validate(cfg(f"data.name={name}:{factory}"))  # only the worker can find these
    with pytest.raises(PluginError) as exc:
        build_data(cfg(f"data.name={name}:{factory}"))
    msg = str(exc.value)
    assert msg.startswith(f"config key data.name: {name}:{factory}" if factory in ("single", "four", "bad_info")
                          else "config key data.name: ")
    assert fragment.format(name=name) in msg and "\n" not in msg


def test_build_data_gives_args_and_path_and_an_empty_info_for_a_pair(plug):
    name = plug(DATA)
    def given(info):  # the plug-in's info; the kit adds its guarded collate (errors name samples and shapes)
        assert callable(info.pop("collate_fn"))
        return info

    train, ev, info = build_data(cfg(f"data.name={name}:pair", "data.args.n_eval=3"))
    assert (len(train), len(ev), given(info)) == (4, 3, {})
    _, _, info = build_data(cfg(f"data.name={name}:seen_path", "data.path=/data/x"))
    assert given(info) == {"path": "/data/x"}
    _, _, info = build_data(cfg(f"data.name={name}:seen_path", "data.path=/data/x", "data.args.path=/other"))
    assert given(info) == {"path": "/other"}  # data.args.path wins over data.path


# ---------------------------------------------------------------- build_model / build_task

RECORDING_MODEL = """
    from torch import nn

    CALLS = []

    def net(num_classes, hidden=4, channels=1):
        CALLS.append(dict(num_classes=num_classes, hidden=hidden, channels=channels))
        return nn.Linear(hidden, num_classes)

    def any_kw(**kwargs):
        CALLS.append(kwargs)
        return nn.Linear(1, 1)

    def needs_depth(depth, num_classes):
        return nn.Linear(depth, num_classes)

    def not_a_module(num_classes):
        return {"num_classes": num_classes}

    def frozen(num_classes):
        return nn.Linear(2, num_classes).requires_grad_(False)

    def no_parameters(num_classes):
        return nn.ReLU()
"""


def test_build_model_passes_the_info_entries_it_names(plug):
    name = plug(RECORDING_MODEL)
    module = sys.modules.get(name) or importlib.import_module(name)
    info = {"num_classes": 3, "vocab_size": 100, "image_size": 8}
    model = build_model(cfg(f"model.name={name}:net", "model.args.hidden=6"), info)
    assert isinstance(model, nn.Linear) and (model.in_features, model.out_features) == (6, 3)
    assert module.CALLS[-1] == {"num_classes": 3, "hidden": 6, "channels": 1}  # not vocab_size / image_size
    build_model(cfg(f"model.name={name}:net", "model.args.num_classes=5"), info)
    assert module.CALLS[-1]["num_classes"] == 5  # model.args win over info
    build_model(cfg(f"model.name={name}:any_kw", "model.args.a=1"), info)
    assert module.CALLS[-1] == {"a": 1}  # **kwargs takes the args, not the whole info


def test_build_model_missing_required_param_non_module_return_and_nothing_to_train(plug):
    name = plug(RECORDING_MODEL)
    with pytest.raises(PluginError) as exc:
        build_model(cfg(f"model.name={name}:needs_depth"), {"num_classes": 3})
    msg = str(exc.value)
    assert msg.startswith("config key model.args.depth:") and "needs depth" in msg and "num_classes" in msg
    with pytest.raises(PluginError, match=r"config key model.name: .*:not_a_module returned a dict, not a torch.nn.Module"):
        build_model(cfg(f"model.name={name}:not_a_module"), {"num_classes": 3})
    for nothing in ("frozen", "no_parameters"):
        with pytest.raises(PluginError, match=rf"config key model.name: .*:{nothing} returned a module with no "
                                              r"parameter that requires a gradient, so there is nothing to train"):
            build_model(cfg(f"model.name={name}:{nothing}"), {"num_classes": 3})


def test_build_task_checks_the_object_and_passes_task_args(plug):
    name = plug("""
        class Evaluates:
            def evaluate(self, model, batch):
                return {}

        def make_task():
            return Evaluates()
    """)
    validate(cfg(f"task.name={name}:make_task"))  # a factory function: its object is only known on the worker
    with pytest.raises(PluginError, match=r"config key task.name: .*:make_task has no loss\(model, batch\) method"):
        build_task(cfg(f"task.name={name}:make_task"))
    task = build_task(cfg("task.args.label_smoothing=0.2"))
    assert isinstance(task, tasks.Classification) and task.label_smoothing == 0.2


# ---------------------------------------------------------------- UserCodeError

USER_CODE = """
    def Net(num_classes, depth=1):
        return layers(depth)

    def layers(depth):
        raise ValueError(f"depth {depth} is not supported")
"""


def _user_error(plug_name: str, step: int, depth: int = 1) -> UserCodeError:
    c = cfg(f"model.name={plug_name}:Net", f"model.args.depth={depth}")
    with pytest.raises(ValueError) as exc:
        build_model(c, {"num_classes": 2})  # called from the kit (plugins.py) and this test
    wrapped = UserCodeError.from_exception(exc.value, rank=3, step=step, roots=plugins.plugin_roots(c))
    assert wrapped is not None
    return wrapped


def test_user_code_error_shows_the_traceback_from_the_users_first_frame(plug):
    name = plug(USER_CODE)
    err = _user_error(name, step=12)
    lines = err.traceback_text.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1].startswith(f'  File "{sys.modules[name].__file__}"') and lines[1].endswith("in Net")
    assert lines[-1] == "ValueError: depth 1 is not supported"
    assert "in layers" in err.traceback_text
    assert "plugins.py" not in err.traceback_text and "test_plugins.py" not in err.traceback_text
    assert (err.summary, str(err), err.rank) == ("ValueError: depth 1 is not supported",) * 2 + (3,)


def test_user_code_error_skips_torchs_call_plumbing(plug):
    """model(x) inside the user's code: nn.Module.__call__'s frames between their call and their forward go."""
    name = plug("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def forward(self, x):
                raise RuntimeError("shape mismatch in forward")

        def step(x):
            return Net()(x)
    """)
    c = cfg(f"model.name={name}:Net")
    module = importlib.import_module(name)
    with pytest.raises(RuntimeError) as exc:
        module.step(torch.zeros(1))
    err = UserCodeError.from_exception(exc.value, 0, 1, plugins.plugin_roots(c))
    assert "in step" in err.traceback_text and "in forward" in err.traceback_text
    assert "_call_impl" not in err.traceback_text and "module.py" not in err.traceback_text
    assert any(f.name == "_call_impl" for f in traceback.extract_tb(exc.value.__traceback__))  # they were there


def test_user_code_error_is_none_outside_the_roots(plug, tmp_path):
    name = plug(USER_CODE)
    try:
        raise KeyError("kit")
    except KeyError as exc:
        assert UserCodeError.from_exception(exc, 0, 1, (str(tmp_path / f"{name}.py"),)) is None
        assert UserCodeError.from_exception(exc, 0, 1, ()) is None


def test_fingerprint_is_the_same_error_at_the_same_step(plug):
    name = plug(USER_CODE)
    a, b = _user_error(name, step=7), _user_error(name, step=7)
    assert a.fingerprint == b.fingerprint
    assert _user_error(name, step=8).fingerprint != a.fingerprint
    assert _user_error(name, step=7, depth=2).fingerprint != a.fingerprint  # another message
    assert "ValueError" in a.fingerprint and "step 7" in a.fingerprint


def test_user_code_error_round_trips_through_pickle(plug):
    err = _user_error(plug(USER_CODE), step=5)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is UserCodeError
    assert (back.summary, back.traceback_text, back.fingerprint, back.rank) == \
        (err.summary, err.traceback_text, err.fingerprint, err.rank)
    assert str(back) == str(err)


def test_plugin_roots_are_the_users_package_or_a_builtins_file(plug):
    name = plug(MODEL, package=True)
    c = cfg(f"model.name={name}:Net", "data.name=synthetic")
    importlib.import_module(name)
    import ray_app.shared.data

    roots = plugins.plugin_roots(c)
    pkg_dir = str(sys.modules[name.split(".")[0]].__file__).rsplit("/", 1)[0]
    assert pkg_dir in roots  # a helper module beside it in the package counts as the user's code
    assert ray_app.shared.data.__file__ in roots
    assert not any(r.endswith("plugins.py") or r.endswith("worker.py") or r.endswith("driver.py") or r.endswith("loop.py") for r in roots)


# ---------------------------------------------------------------- the failure policy

def _policy(max_failures=3):
    from ray.train import FailureConfig

    from ray_app.controller.failure_policy import KitFailurePolicy

    return KitFailurePolicy(FailureConfig(max_failures=max_failures))


def _group_error(*errors):
    from ray.train.v2.api.exceptions import WorkerGroupError

    return WorkerGroupError("worker errors", dict(enumerate(errors)))


def _uce(fingerprint: str) -> UserCodeError:
    return UserCodeError("ValueError: x", "Traceback ...", fingerprint, rank=0)


def test_bad_input_ends_the_run_at_once():
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    assert _policy().make_decision(_group_error(ConfigError("config key data.path: x"))) == FailureDecision.RAISE
    assert _policy().make_decision(_group_error(RuntimeError("lost"), PluginError("bad"))) == FailureDecision.RAISE


def test_a_user_error_is_retried_once_and_raised_when_it_recurs():
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    policy = _policy()
    assert policy.make_decision(_group_error(_uce("A|step 3"))) == FailureDecision.RETRY
    assert policy.make_decision(_group_error(_uce("A|step 3"), _uce("A|step 3"))) == FailureDecision.RAISE


def test_different_user_errors_are_retried():
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    policy = _policy()
    assert policy.make_decision(_group_error(_uce("A|step 3"))) == FailureDecision.RETRY
    assert policy.make_decision(_group_error(_uce("A|step 4"))) == FailureDecision.RETRY
    assert policy.make_decision(_group_error(_uce("B|step 4"))) == FailureDecision.RETRY


def test_other_failures_follow_rays_default():
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    policy = _policy(max_failures=3)
    decisions = [policy.make_decision(_group_error(RuntimeError("node lost"))) for _ in range(4)]
    assert decisions == [FailureDecision.RETRY] * 3 + [FailureDecision.RAISE]


# ---------------------------------------------------------------- built-in tasks

class Emb(nn.Module):
    """A tiny language model: token -> logits over the vocabulary."""

    def __init__(self, vocab=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, vocab)

    def forward(self, x):
        return self.emb(x)


def test_tasks_follow_the_protocol():
    for cls in (tasks.Classification, tasks.Regression, tasks.LanguageModel):
        assert isinstance(cls(), tasks.Task)


def test_classification_loss_and_per_sample_metrics():
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 3), torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    task = tasks.Classification()
    loss, n = task.loss(model, (x, y))
    assert n == 5 and loss.shape == () and torch.allclose(loss, F.cross_entropy(model(x), y))
    m = task.evaluate(model, (x, y))
    assert set(m) == {"loss", "accuracy"} and m["loss"].shape == m["accuracy"].shape == (5,)
    assert torch.allclose(m["loss"].mean(), loss)
    assert torch.equal(m["accuracy"], (model(x).argmax(1) == y).double())
    # a dict batch, with the default or the configured keys
    assert torch.allclose(task.loss(model, {"input": x, "target": y})[0], loss)
    keyed = tasks.Classification(input_key="image", target_key="label")
    assert torch.allclose(keyed.loss(model, {"image": x, "label": y, "id": 7})[0], loss)
    smoothed, _ = tasks.Classification(label_smoothing=0.3).loss(model, [x, y])
    assert not torch.allclose(smoothed, loss)
    with pytest.raises(TypeError, match="'input' and 'target'"):
        task.loss(model, x)


def test_regression_loss_and_per_sample_metrics():
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 2), torch.randn(6, 4), torch.randn(6, 2)
    task = tasks.Regression()
    loss, n = task.loss(model, (x, y))
    assert n == 6 and torch.allclose(loss, F.mse_loss(model(x), y))
    m = task.evaluate(model, {"input": x, "target": y})
    assert set(m) == {"mse", "mae"} and m["mse"].shape == m["mae"].shape == (6,)
    err = model(x) - y
    assert torch.allclose(m["mse"], err.pow(2).mean(1)) and torch.allclose(m["mae"], err.abs().mean(1))
    assert torch.allclose(m["mse"].mean(), loss)


def test_language_model_loss_per_token_and_perplexity():
    torch.manual_seed(0)
    model, x, y = Emb(), torch.randint(0, 5, (3, 4)), torch.randint(0, 5, (3, 4))
    task = tasks.LanguageModel()
    loss, n = task.loss(model, (x, y))
    assert n == 3 and torch.allclose(loss, F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1)))
    m = task.evaluate(model, {"input": x, "target": y})
    assert set(m) == {"loss"} and m["loss"].shape == (3,)
    per_token = F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1), reduction="none").view(3, 4)
    assert torch.allclose(m["loss"], per_token.mean(1))
    # ignored tokens count in neither the loss nor the per-sample mean
    y2 = y.clone()
    y2[0, 2:] = -100
    m2 = task.evaluate(model, (x, y2))
    assert torch.allclose(m2["loss"][0], per_token[0, :2].mean()) and torch.allclose(m2["loss"][1:], m["loss"][1:])
    assert task.summarize({"loss": 1.5}) == {"perplexity": pytest.approx(math.exp(1.5))}
    assert task.summarize({"loss": m["loss"].mean().item()})["perplexity"] == pytest.approx(math.exp(m["loss"].mean().item()))
    assert math.isfinite(task.summarize({"loss": 1e6})["perplexity"])  # a diverged run does not overflow
