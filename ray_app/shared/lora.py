"""``model.lora``: its keys read and checked (one line, exit 2, before Ray), without importing peft."""

from __future__ import annotations

from ray_app.shared.errors import ConfigError

DEFAULTS = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}


def lora_settings(lora: dict) -> dict | None:
    """``model.lora`` with its defaults filled in, or None when it is empty (LoRA off)."""
    if not lora:
        return None
    unknown = sorted(set(lora) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"config key model.lora: unknown key {', '.join(map(str, unknown))}; "
                          f"known: {', '.join(DEFAULTS)}")
    out = DEFAULTS | dict(lora)
    if isinstance(out["r"], bool) or not isinstance(out["r"], int) or out["r"] < 1:
        raise ConfigError(f"config key model.lora.r: expected a positive integer, got {out['r']!r}")
    for key in ("alpha", "dropout"):
        if isinstance(out[key], bool) or not isinstance(out[key], (int, float)) or out[key] < 0:
            raise ConfigError(f"config key model.lora.{key}: expected a number >= 0, got {out[key]!r}")
    if out["dropout"] >= 1:
        raise ConfigError(f"config key model.lora.dropout: expected below 1, got {out['dropout']!r}")
    targets = out["target_modules"]
    if isinstance(targets, str):
        targets = [targets]
    if targets is not None and (not targets or not all(isinstance(t, str) and t for t in targets)):
        raise ConfigError(f"config key model.lora.target_modules: expected a list of module names such as "
                          f"[q_proj, v_proj], got {targets!r}")
    out["target_modules"] = list(targets) if targets is not None else None
    return out
