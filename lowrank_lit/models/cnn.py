"""A small CNN for 16x16 digit images (the source model of the test-time adaptation experiments): GroupNorm by
default, BatchNorm with ``norm="batch"`` (the normalisation most test-time adaptation baselines assume)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GroupNormCNN"]


class GroupNormCNN(nn.Module):
    """``len(widths)`` x (conv3x3 -> GroupNorm -> ReLU), 2x2 max-pool after all but the last, global average pool, linear.

    GroupNorm (not BatchNorm) so that input shifts are not undone by batch statistics: the corruption
    stream really degrades the source model, and test-time adaptation of the norm affine parameters
    has something to fix.

    Args:
        in_chans: input channels. Default: 1.
        num_classes: outputs. Default: 10.
        widths: channels of the conv blocks. Default: [32, 64, 64].
        groups: GroupNorm groups. Default: 4.
        norm: ``group`` (GroupNorm) or ``batch`` (BatchNorm2d; test-batch statistics are then what Tent and
            AdaBN adapt, and label-correlated streams what breaks them). Default: group.
    """

    NORMS = ("group", "batch")

    def __init__(self, in_chans: int = 1, num_classes: int = 10, widths: list[int] | None = None, groups: int = 4,
                 norm: str = "group") -> None:
        super().__init__()
        widths = [32, 64, 64] if widths is None else list(widths)
        if norm not in self.NORMS:
            raise ValueError(f"GroupNormCNN: norm={norm!r}; allowed: {', '.join(self.NORMS)}")
        if norm == "group" and any(w % groups for w in widths):
            raise ValueError(f"GroupNormCNN: every width in {widths} must be divisible by groups={groups}")
        blocks = []
        width = in_chans
        for i, w in enumerate(widths):
            layers: list[nn.Module] = [nn.Conv2d(width, w, 3, padding=1),
                                       nn.GroupNorm(groups, w) if norm == "group" else nn.BatchNorm2d(w), nn.ReLU()]
            if i < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            blocks.append(nn.Sequential(*layers))
            width = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.blocks(x)  # (B, C, h, w)
        return self.head(z.mean(dim=(2, 3)))  # (B, num_classes)
