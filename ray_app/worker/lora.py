"""``model.lora``: the model wrapped by peft's LoRA before it is sharded or wrapped, so that under FSDP the
frozen base is sharded too. Only the adapters require gradients (the optimizer takes only those) and only
they go into checkpoints (``ray_app.worker.strategy``); the base is read from ``model.args.path`` at every start.

A model made on the meta device (``model.name: hf``): peft wraps it there; the adapters' initial values are
made real here, seeded (the same on every rank), and ``ray_app.worker.pretrained`` fills them after sharding
along with the base, whose names in the wrapped model map back to the file's (``file_name``).
"""

from __future__ import annotations

import torch

from ray_app.shared.errors import ConfigError
from ray_app.shared.lora import lora_settings

PREFIX = "base_model.model."


def file_name(name: str) -> str:
    """A wrapped model's name of a base tensor as the unwrapped model (and its files) name it."""
    if name.startswith(PREFIX):
        name = name[len(PREFIX):]
    return name.replace(".base_layer.", ".")


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a PeftModel, or one DDP wraps) carries LoRA adapters."""
    return getattr(getattr(model, "module", model), "peft_config", None) is not None


def linear_names(module: torch.nn.Module) -> list[str]:
    """The distinct leaf names of the model's Linear modules (what ``target_modules`` can name)."""
    return sorted({name.rpartition(".")[2] for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)})


def lora_config(settings: dict):
    from peft import LoraConfig

    return LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                      target_modules=settings["target_modules"])


def apply_lora(module: torch.nn.Module, lora: dict) -> torch.nn.Module:
    """``module`` wrapped by peft's LoRA per ``model.lora`` (``module`` itself when it is empty). The caller
    seeds the RNG first: the adapters' init is then the same on every rank."""
    settings = lora_settings(lora)
    if settings is None:
        return module
    from peft import get_peft_model

    weights = getattr(module, "ray_app_weights", None)
    targets = settings["target_modules"]
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if targets is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

        if model_type not in DEFAULT_TARGETS:
            raise ConfigError(f"config key model.lora.target_modules: required for this model (peft has no default "
                              f"for {model_type or type(module).__name__}); its Linear modules: "
                              f"{', '.join(linear_names(module))}")
    else:
        names = [name for name, _ in module.named_modules()]
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]  # peft's rule
        if missing:
            raise ConfigError(f"config key model.lora.target_modules: {', '.join(missing)} match no module of the "
                              f"model; its Linear modules: {', '.join(linear_names(module))}")
    try:
        model = get_peft_model(module, lora_config(settings))
    except ValueError as exc:  # peft's word for a target it cannot adapt
        raise ConfigError(f"config key model.lora.target_modules: {str(exc).splitlines()[0]}; the model's Linear "
                          f"modules: {', '.join(linear_names(module))}") from None
    if weights is not None:  # made on meta: the base is read after sharding, the adapters start from these
        del module.ray_app_weights
        model.ray_app_weights = weights
        model.ray_app_adapters = _initial_adapters(model)
    return model


def check_targets(args: dict, lora: dict, retry_s: float) -> None:
    """Before Ray (``model.name: hf``): ``model.lora`` applied to the model made on meta from its config
    alone, so a target that matches nothing is one line there."""
    from ray_app.shared.hf import pretrained

    apply_lora(pretrained(**{**args, "retry_s": retry_s}), lora)


def _initial_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' initial values, made real on the CPU by peft's own init (in module order, from the seeded
    RNG: the same on every rank), keyed by parameter name; the model's adapters stay on meta until
    ``load_pretrained`` fills them."""
    from peft.tuners.lora import LoraLayer

    for m in model.modules():
        if isinstance(m, LoraLayer):
            for adapter in m.active_adapters:
                m.lora_A[adapter].to_empty(device="cpu")
                m.lora_B[adapter].to_empty(device="cpu")
                m.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    for m in model.modules():
        if isinstance(m, LoraLayer):
            for adapter in m.active_adapters:
                m.lora_A[adapter].to("meta")
                m.lora_B[adapter].to("meta")
    return adapters
