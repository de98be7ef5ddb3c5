"""``ray-app eval``: distributed, exact evaluation of a saved checkpoint.

The data, model and task are rebuilt from the checkpoint's own config (``--set`` may change
keys such as ``scaling.num_workers``); the workers run the same launch path as training.
"""

from __future__ import annotations

import tempfile

from ray_app.config import ConfigError, config_from_dict


def run_eval(uri: str, overrides: list[str]) -> dict:
    from ray_app.checkpoint import CheckpointError, load_verified, resolve_checkpoint_uri
    from ray_app.launch import UserError, launch, validate_before_ray

    try:
        storage, rel = resolve_checkpoint_uri(uri)
        loaded = load_verified(storage, rel, rank=None, model_only=True)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    try:
        cfg = config_from_dict(loaded.config, overrides)
    except ConfigError as exc:
        raise ConfigError(f"--set: {exc}") from None
    validate_before_ray(cfg)
    m = launch(cfg, {"mode": "eval", "checkpoint": loaded.uri}, f"eval-{cfg.run.name}",
               tempfile.mkdtemp(prefix="ray-app-eval-"))
    return {"checkpoint": m["checkpoint"], "global_step": m["global_step"],
            **{k: v for k, v in m.items() if k.startswith("eval_")},
            "num_samples": m["num_samples"], "world_size": cfg.scaling.num_workers}
