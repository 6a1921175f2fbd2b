"""Factorized low-rank replacements for ``nn.Linear`` (used by truncation of rank-regularized layers)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LowRankLinear", "svd_factorize", "factor_ranks", "with_factors"]


class LowRankLinear(nn.Module):
    """``y = concat_k(up_k(down(x)_k))``: a Linear factorized per row block.

    With one block this is the usual ``Linear(in, r, bias=False)`` followed by ``Linear(r, out)``;
    a fused projection (timm's qkv) keeps one rank per slice: ``down`` maps to ``sum(ranks)``
    features and block ``k`` is lifted by its own ``up_k`` to its rows. Parameters:
    ``in * sum(ranks) + sum_k ranks[k] * rows[k] + out``.

    Args:
        in_features: input features.
        row_sizes: output rows per block (their sum is ``out_features``).
        ranks: rank of each block, ``1 <= ranks[k]``.
        bias: learn an output bias. Default: True.
    """

    def __init__(self, in_features: int, row_sizes: list[int], ranks: list[int], bias: bool = True) -> None:
        super().__init__()
        if len(row_sizes) != len(ranks) or not ranks or min(ranks) < 1:
            raise ValueError(f"LowRankLinear: ranks={ranks} must be >= 1, one per block of row_sizes={row_sizes}")
        self.in_features = in_features
        self.out_features = sum(row_sizes)
        self.row_sizes = list(row_sizes)
        self.ranks = list(ranks)
        self.down = nn.Linear(in_features, sum(ranks), bias=False)
        self.up = nn.ModuleList(nn.Linear(r, rows, bias=bias) for r, rows in zip(ranks, row_sizes, strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x).split(self.ranks, dim=-1)  # (..., r_k) per block
        return torch.cat([up(hk) for up, hk in zip(self.up, h, strict=True)], dim=-1)  # (..., out)


def svd_factorize(linear: nn.Linear, row_slices: list[slice], ranks: list[int]) -> LowRankLinear:
    """Best rank-``ranks[k]`` approximation of each row block of ``linear.weight`` (truncated SVD).

    Row slices must tile ``linear.weight`` in order (e.g. ``[slice(0, d), slice(d, 2d), slice(2d, 3d)]``).
    """
    W = linear.weight.detach().float()  # (out, in)
    rows = [s.stop - s.start for s in row_slices]
    layer = LowRankLinear(linear.in_features, rows, ranks, bias=linear.bias is not None)
    downs = []
    with torch.no_grad():
        for k, (s, r) in enumerate(zip(row_slices, ranks, strict=True)):
            U, S, Vh = torch.linalg.svd(W[s], full_matrices=False)  # (rows, m), (m,), (m, in)
            root = S[:r].sqrt()
            layer.up[k].weight.copy_(U[:, :r] * root)  # (rows, r)
            downs.append(root[:, None] * Vh[:r])  # (r, in)
            if linear.bias is not None:
                layer.up[k].bias.copy_(linear.bias[s])
        layer.down.weight.copy_(torch.cat(downs, dim=0))
    return layer.to(dtype=linear.weight.dtype, device=linear.weight.device)


def factor_ranks(model: nn.Module) -> dict[str, list[int]]:
    """``name -> ranks`` of every :class:`LowRankLinear` in ``model`` (what a ``factors`` export records)."""
    return {n: list(m.ranks) for n, m in model.named_modules() if isinstance(m, LowRankLinear)}


def with_factors(model: nn.Module, ranks: dict[str, list[int]]) -> nn.Module:
    """``model`` with each Linear named in ``ranks`` replaced, in place, by an (untrained) :class:`LowRankLinear` of
    those ranks over equal row blocks: the shape a ``factors`` export's weights are loaded into."""
    from lowrank_lit.nn.targets import replace_module

    for name, r in ranks.items():
        old = model.get_submodule(name)
        rows = [old.out_features // len(r)] * len(r)
        replace_module(model, name, LowRankLinear(old.in_features, rows, list(r), bias=old.bias is not None))
    return model
