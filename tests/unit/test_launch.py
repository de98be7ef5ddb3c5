"""The trainer the kit builds: Ray Train V2 callbacks it keeps and leaves out (no Ray cluster needed)."""

from __future__ import annotations

from ray_app.config import load_config
from ray_app.launch import LEAN_DROPPED_CALLBACKS, build_trainer, lean_trainer_class
from ray_app.storage import open_storage


def _callback_names(trainer) -> set[str]:
    return {type(cb).__name__ for cb in trainer._create_default_callbacks()}


def test_kit_trainer_leaves_out_the_unused_actors(tmp_path):
    cfg = load_config(None, [f"run.storage={tmp_path}"])
    names = _callback_names(build_trainer(cfg, open_storage(cfg.run.storage)))
    # what sets up the devices and the process group stays
    assert {"AcceleratorSetupCallback", "BackendSetupCallback"} <= names
    assert not names & set(LEAN_DROPPED_CALLBACKS)


def test_datasets_keep_their_callback():
    from ray.train.torch import TorchTrainer

    lean = lean_trainer_class()
    assert issubclass(lean, TorchTrainer)
    with_data = lean(lambda: None, datasets={"train": lambda: None})
    names = _callback_names(with_data)
    assert "DatasetsCallback" in names and "PlacementGroupCleanerCallback" not in names
    assert "PlacementGroupCleanerCallback" in _callback_names(TorchTrainer(lambda: None))
