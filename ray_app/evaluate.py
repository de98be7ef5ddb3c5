"""``ray-app eval``: distributed, exact evaluation of a saved checkpoint."""

from __future__ import annotations

import tempfile

from ray_app.config import ConfigError, config_from_dict, parse_override


def _merge(tree: dict, overrides: list[str]) -> dict:
    for text in overrides:
        for section, values in parse_override(text).items():
            tree.setdefault(section, {}).update(values)
    return tree


def eval_func(args: dict) -> None:
    """Each Ray Train worker: build the model from the checkpoint's config, load weights, evaluate."""
    import ray.train

    from ray_app.checkpoint import load_verified, resolve_checkpoint_uri
    from ray_app.launch import RayRuntime
    from ray_app.loop import Trainer
    from ray_app.metrics import NullMetrics
    from ray_app.storage import open_storage

    cfg = config_from_dict(args["config"])
    runtime = RayRuntime(cfg.scaling.use_gpu, open_storage(cfg.run.storage), cfg.run.name, "sync")
    trainer = Trainer(cfg, runtime, checkpointer=None, metrics=NullMetrics())
    trainer.build()
    storage, rel = resolve_checkpoint_uri(args["checkpoint"])
    loaded = load_verified(storage, rel, rank=None, model_only=True)
    trainer.module.load_state_dict(loaded.model)
    result = dict(trainer.evaluate(), checkpoint=loaded.uri, global_step=loaded.state.get("global_step"))
    if runtime.rank == 0:
        # Ray Train V2's Result.metrics only carries metrics reported with a checkpoint; eval writes
        # none, so rank 0 hands its result to the driver through a queue actor
        args["results"].put(result)
    ray.train.report(result)


def run_eval(uri: str, overrides: list[str]) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_app.checkpoint import CheckpointError, load_verified, resolve_checkpoint_uri
    from ray_app.launch import TrainingFailed, UserError, driver_node_queue, init_ray

    try:
        storage, rel = resolve_checkpoint_uri(uri)
        loaded = load_verified(storage, rel, rank=None, model_only=True)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    try:
        cfg = config_from_dict(_merge(loaded.config, overrides))
    except ConfigError as exc:
        raise ConfigError(f"--set: {exc}") from None
    init_ray(cfg)

    results = driver_node_queue()
    s = cfg.scaling
    resources = {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if s.use_gpu else {})}
    trainer = TorchTrainer(
        eval_func,
        train_loop_config={"config": cfg.to_dict(), "checkpoint": loaded.uri, "results": results},
        scaling_config=ScalingConfig(num_workers=s.num_workers, use_gpu=s.use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
        run_config=RunConfig(name=f"eval-{cfg.run.name}", storage_path=tempfile.mkdtemp(prefix="ray-app-eval-")),
    )
    result = trainer.fit()
    m = results.get(timeout=30) if result.error is None and not results.empty() else None
    import ray

    ray.shutdown()
    if result.error is not None:
        raise TrainingFailed(str(result.error).strip().splitlines()[-1][:500])
    if m is None:
        raise TrainingFailed("evaluation finished but rank 0 returned no result")
    return {"checkpoint": m["checkpoint"], "global_step": m["global_step"], "eval_accuracy": m["eval_accuracy"],
            "eval_loss": m["eval_loss"], "num_samples": m["num_samples"], "world_size": s.num_workers}
