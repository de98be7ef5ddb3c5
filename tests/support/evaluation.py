"""A single-process evaluation of the default config's model and eval set: what the kit's distributed,
exact evaluation must equal."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accuracy_and_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of one batch of logits, the means in float64."""
    losses = F.cross_entropy(logits, targets, reduction="none").double()
    return (logits.argmax(1) == targets).double().mean().item(), losses.mean().item()


def default_model_eval(state_dict: dict) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``state_dict`` loaded into the default config's model, over the
    whole eval set in one batch, in float64 for the means."""
    from ray_app.shared.config import load_config
    from ray_app.shared.plugins import build_data, build_model

    cfg = load_config(None, [])
    _, ev, info = build_data(cfg)
    model = build_model(cfg, info)
    model.load_state_dict(state_dict)
    model.eval()
    with torch.no_grad():
        logits = model(ev.tensors[0])
    return accuracy_and_loss(logits, ev.tensors[1])
