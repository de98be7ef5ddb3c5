"""``ray-app eval``: distributed, exact evaluation of a saved checkpoint.

The data, model and task are rebuilt from the checkpoint's own config (``--set`` may change
keys such as ``scaling.num_workers``); the workers run the same launch path as training.
"""

from __future__ import annotations

import tempfile

from ray_app.config import ConfigError, config_from_dict


def run_eval(uri: str, overrides: list[str]) -> dict:
    from ray_app.checkpoint import CheckpointError, committed_config
    from ray_app.launch import UserError, launch, validate_before_ray

    try:
        checkpoint, saved = committed_config(uri)  # its manifest and config.json: the workers load the rest
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    try:
        cfg = config_from_dict(saved, overrides)
    except ConfigError as exc:
        raise ConfigError(f"--set: {exc}") from None
    validate_before_ray(cfg)
    m = launch(cfg, {"mode": "eval", "checkpoint": checkpoint}, f"eval-{cfg.run.name}",
               tempfile.mkdtemp(prefix="ray-app-eval-"))
    return {"checkpoint": m["checkpoint"], "global_step": m["global_step"],
            **{k: v for k, v in m.items() if k.startswith("eval_")},
            "num_samples": m["num_samples"], "world_size": cfg.scaling.num_workers}
