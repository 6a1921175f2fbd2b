"""Small metrics shared across packages (plain Python; the bottom of the package)."""

from __future__ import annotations

from collections import Counter

__all__ = ["purity"]


def purity(clusters: list[int], domains: list[int]) -> float:
    """Fraction of batches whose cluster's majority domain is their own domain."""
    by: dict[int, Counter] = {}
    for c, d in zip(clusters, domains, strict=True):
        by.setdefault(c, Counter())[d] += 1
    return sum(cnt.most_common(1)[0][1] for cnt in by.values()) / max(len(clusters), 1)
