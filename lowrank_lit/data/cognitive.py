"""Compositional cognitive tasks built from a shared epoch vocabulary (the Yang et al. 2019 family).

A trial is a sequence of epochs; each epoch fixes what the inputs show and what the outputs must be:

* inputs ``s_t = [fixation, cos(theta) * stim, sin(theta) * stim] + noise`` (3),
* targets ``y_t = [fixation, response cos, response sin]`` (3).

=========  ======  ==================  ===================================
epoch      steps   inputs              targets
=========  ======  ==================  ===================================
F (fix)    10      fix 1               fix 1
S (stim)   15      fix 1, stimulus     fix 1
M (memory) 15      fix 1               fix 1
R_pro      15      fix 0               response (cos theta, sin theta)
R_anti     15      fix 0               response (-cos theta, -sin theta)
=========  ======  ==================  ===================================

Tasks: ``DelayPro = F, S, R_pro``; ``DelayAnti = F, S, R_anti``; ``MemoryPro = F, S, M, R_pro``;
``MemoryAnti = F, S, M, R_anti``. Epoch lengths and noise follow our spec; neurogym's DelayPro / DelayAnti
(``neurogym.envs.yang19``) differ in timing (random delays) and noise, which we keep fixed here so trials
batch into one tensor. Every batch is drawn from a seeded generator (per rank and step).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["EPOCHS", "TASKS", "EPOCH_STEPS", "make_trials", "response_accuracy"]

EPOCHS = ("F", "S", "M", "R_pro", "R_anti")
EPOCH_STEPS = {"F": 10, "S": 15, "M": 15, "R_pro": 15, "R_anti": 15}
TASKS: dict[str, tuple[str, ...]] = {
    "DelayPro": ("F", "S", "R_pro"),
    "DelayAnti": ("F", "S", "R_anti"),
    "MemoryPro": ("F", "S", "M", "R_pro"),
    "MemoryAnti": ("F", "S", "M", "R_anti"),
}


def make_trials(task: str, n: int, generator: torch.Generator, noise: float = 0.05) -> dict[str, Any]:
    """``n`` trials of ``task``: ``inputs (n, T, 3)``, ``targets (n, T, 3)``, ``epochs (n, T)`` (indices into
    :data:`EPOCHS`), ``theta (n,)``, ``mask (n, T, 3)`` (loss weights: fixation 1 everywhere, response 5 in the
    response epoch and 0 elsewhere)."""
    if task not in TASKS:
        raise ValueError(f"make_trials: task={task!r}; allowed: {', '.join(TASKS)}")
    if noise < 0:
        raise ValueError(f"make_trials: noise={noise!r}; allowed: >= 0")
    seq = [e for e in TASKS[task] for _ in range(EPOCH_STEPS[e])]
    T = len(seq)
    epochs = torch.tensor([EPOCHS.index(e) for e in seq]).expand(n, T)  # (n, T)
    theta = torch.rand(n, generator=generator) * 2 * math.pi
    cs = torch.stack([theta.cos(), theta.sin()], 1)  # (n, 2)
    fix = torch.tensor([0.0 if e.startswith("R") else 1.0 for e in seq])  # (T,)
    stim = torch.tensor([1.0 if e == "S" else 0.0 for e in seq])
    sign = torch.tensor([1.0 if e == "R_pro" else -1.0 if e == "R_anti" else 0.0 for e in seq])
    inputs = torch.cat([fix.expand(n, T)[..., None], stim[None, :, None] * cs[:, None]], -1)  # (n, T, 3)
    inputs = inputs + noise * torch.randn(inputs.shape, generator=generator)
    targets = torch.cat([fix.expand(n, T)[..., None], sign[None, :, None] * cs[:, None]], -1)
    resp = (sign != 0).float()
    mask = torch.stack([torch.ones(T), 5 * resp, 5 * resp], -1).expand(n, T, 3)
    return {"inputs": inputs, "targets": targets, "epochs": epochs.clone(), "theta": theta, "mask": mask.clone()}


def response_accuracy(outputs: torch.Tensor, targets: torch.Tensor, epochs: torch.Tensor, tol: float = math.pi / 10) -> float:
    """Fraction of response-epoch steps whose output angle is within ``tol`` of the target angle."""
    resp = (epochs == EPOCHS.index("R_pro")) | (epochs == EPOCHS.index("R_anti"))  # (n, T)
    if not bool(resp.any()):
        raise ValueError("response_accuracy: no response epoch in the trials")
    ang = torch.atan2(outputs[..., 2], outputs[..., 1]) - torch.atan2(targets[..., 2], targets[..., 1])
    err = torch.atan2(ang.sin(), ang.cos()).abs()
    return float((err[resp] < tol).float().mean())
