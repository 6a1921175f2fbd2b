"""A plain multilayer perceptron backbone."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP"]

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


class MLP(nn.Module):
    """``in_features -> hidden[0] -> ... -> hidden[-1] -> num_classes`` with an activation between layers.

    Inputs of any shape ``(B, *)`` are flattened to ``(B, in_features)``.

    Args:
        in_features: size of one flattened input. Default: 64 (an 8x8 grey digit).
        num_classes: number of outputs. Default: 10.
        hidden: widths of the hidden layers. Default: [256, 128].
        activation: one of ``relu``, ``gelu``, ``tanh``, ``silu``. Default: ``gelu``.
        dropout: dropout probability after each hidden activation. Default: 0.0.
    """

    def __init__(
        self,
        in_features: int = 64,
        num_classes: int = 10,
        hidden: list[int] | None = None,
        activation: str = "gelu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        hidden = [256, 128] if hidden is None else list(hidden)
        if in_features < 1 or num_classes < 1 or any(h < 1 for h in hidden):
            raise ValueError(
                f"MLP: in_features={in_features}, num_classes={num_classes}, hidden={hidden}; allowed: positive integers"
            )
        if activation not in _ACTIVATIONS:
            raise ValueError(f"MLP: activation={activation!r}; allowed: {', '.join(_ACTIVATIONS)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MLP: dropout={dropout!r}; allowed: a float in [0, 1)")
        self.in_features = in_features
        self.num_classes = num_classes
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), _ACTIVATIONS[activation]()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))  # (B, *) -> (B, in_features) -> (B, num_classes)
