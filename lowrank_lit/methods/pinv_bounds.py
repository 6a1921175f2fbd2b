"""Perturbation Bounds for Low-Rank Inverse Approximations under Noise.

Tran & Vishnoi, NeurIPS 2025 (arXiv 2510.25571; OpenReview bPNzBXl1n7). No public code.

For symmetric positive definite ``A`` (eigenvalues ``l_1 >= ... >= l_n > 0``), a noisy copy
``A + E`` and the best rank-p approximation of the inverse (the p eigenpairs with the smallest
``|lambda|``, inverted), Theorem 2.1 bounds the spectral-norm error linearly in ``||E||``::

    ||((A+E)^-1)_p - A_p^-1||  <=  4 ||E|| / l_n^2  +  5 ||E|| / (l_{n-p} * delta_{n-p})
    delta_{n-p} = l_{n-p} - l_{n-p+1},   valid when   4 ||E|| <= min(l_n, delta_{n-p})   (gap condition)

The classical route (Eckart-Young-Mirsky + Neumann series, "EYM-N") leaves a term ~ 2 / l_{n-p}
that does not vanish as ``E -> 0``. Its exact form is in the paper's Appendix A; here it is the
triangle inequality through ``(A+E)^-1`` and ``A^-1`` (inferred, as on the method card)::

    ||E|| / (l_n (l_n - ||E||))  +  1 / (l_{n-p} - ||E||)  +  1 / l_{n-p}

The bounds need only the p+1 eigenvalues closest to 0, so they can be evaluated from a partial
eigensolver (:func:`lowrank_lit.linalg.smallest_eigenpairs`). Everything is float64.
Indefinite ``A`` (the paper's Theorem 4.1 setting): :func:`best_rank_p_inverse` and
:func:`lowrank_inverse_error` keep the p smallest ``|lambda|``; :func:`contour_bound` refuses such ``A``.
"""

from __future__ import annotations

import math

import torch

from lowrank_lit.linalg import check_symmetric, spectral_norm_sym

__all__ = [
    "best_rank_p_inverse",
    "lowrank_inverse_error",
    "contour_bound",
    "eym_neumann_bound",
    "gap_condition_holds",
    "max_noise_std",
    "symmetric_noise",
]


def _check_p(p: int, n: int, name: str = "p") -> None:
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= n:
        raise ValueError(f"{name}={p!r}; allowed: an integer in [1, n] = [1, {n}]")


def best_rank_p_inverse(A: torch.Tensor, p: int) -> torch.Tensor:
    """``A_p^-1 = sum over the p eigenpairs of smallest |lambda| of u u^T / lambda`` (float64, symmetric).

    ``p = n`` gives ``A^-1``.

    Raises:
        ValueError: A not square/symmetric/finite, p outside [1, n], a zero eigenvalue among the kept
            ones, or a tie at the cut (the rank-p inverse is not unique).
    """
    A = check_symmetric(A, "A")
    n = A.shape[0]
    _check_p(p, n)
    w, V = torch.linalg.eigh(A)
    order = torch.argsort(w.abs())
    w, V = w[order], V[:, order]  # ascending |lambda|
    if p < n and math.isclose(abs(float(w[p - 1])), abs(float(w[p])), rel_tol=1e-12, abs_tol=0.0):
        raise ValueError(f"rank-p inverse not unique: |lambda| ties at the cut p={p}")
    if float(w[:p].abs().min()) == 0.0:
        raise ValueError("A is singular among the kept eigenvalues (lambda = 0)")
    Vp = V[:, :p]  # (n, p)
    return (Vp / w[:p]) @ Vp.T  # (n, n)


def lowrank_inverse_error(A: torch.Tensor, E: torch.Tensor, p: int) -> float:
    """``||((A+E)^-1)_p - A_p^-1||_2`` (spectral norm), float64.

    Raises:
        ValueError: as :func:`best_rank_p_inverse`, or E of another shape / not symmetric / not finite.
    """
    A = check_symmetric(A, "A")
    E = check_symmetric(E, "E")
    if E.shape != A.shape:
        raise ValueError(f"E has shape {tuple(E.shape)}; allowed: the shape of A, {tuple(A.shape)}")
    return spectral_norm_sym(best_rank_p_inverse(A + E, p) - best_rank_p_inverse(A, p))


def _spd_tail(eigvals: torch.Tensor, p: int) -> tuple[float, float, float]:
    """``(l_n, l_{n-p+1}, l_{n-p})`` from any set of eigenvalues holding at least the p+1 smallest."""
    w = torch.as_tensor(eigvals, dtype=torch.float64).flatten()
    if not torch.isfinite(w).all():
        raise ValueError("eigvals has NaN or Inf entries")
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p < len(w):
        raise ValueError(f"p={p!r}; allowed: an integer in [1, {len(w) - 1}] (the bounds need lambda_(n-p))")
    w = torch.sort(w).values  # ascending
    if float(w[0]) <= 0:
        raise ValueError(
            f"A must be positive definite for Theorem 2.1 (lambda_n = {float(w[0]):.3g}); for indefinite A "
            "use the Theorem 4.1 setting (lowrank_inverse_error keeps the p smallest |lambda|)"
        )
    return float(w[0]), float(w[p - 1]), float(w[p])


def gap_condition_holds(eigvals: torch.Tensor, E_norm: float, p: int) -> bool:
    """``4 ||E|| <= min(lambda_n, delta_{n-p})``."""
    if not E_norm >= 0:
        raise ValueError(f"E_norm={E_norm!r}; allowed: a number >= 0")
    ln, lkept, lcut = _spd_tail(eigvals, p)
    return 4.0 * E_norm <= min(ln, lcut - lkept)


def contour_bound(eigvals: torch.Tensor, E_norm: float, p: int) -> float:
    """Theorem 2.1: ``4||E||/l_n^2 + 5||E||/(l_{n-p} delta_{n-p})``.

    Args:
        eigvals: eigenvalues of A (all, or at least the p+1 smallest).
        E_norm: spectral norm of the perturbation.
        p: rank of the inverse approximation, 1 <= p < n.

    Raises:
        ValueError: the gap condition fails (the bound does not apply), delta_{n-p} = 0 (rank-p
            inverse not unique), A not positive definite, or bad p / E_norm.
    """
    ln, lkept, lcut = _spd_tail(eigvals, p)
    delta = lcut - lkept
    if delta <= 0:
        raise ValueError(f"rank-p inverse not unique: delta_(n-p) = 0 at p={p}")
    if not gap_condition_holds(eigvals, E_norm, p):
        raise ValueError(
            f"gap condition fails: 4||E|| = {4 * E_norm:.3g} > min(lambda_n, delta_(n-p)) = {min(ln, delta):.3g}; "
            "Theorem 2.1 does not apply"
        )
    return 4.0 * E_norm / ln**2 + 5.0 * E_norm / (lcut * delta)


def eym_neumann_bound(eigvals: torch.Tensor, E_norm: float, p: int) -> float:
    """The classical EYM + Neumann + Weyl bound (inferred form, see the module docstring).

    Returns ``inf`` when ``||E|| >= lambda_n`` (the Neumann series does not converge).
    """
    if not E_norm >= 0:
        raise ValueError(f"E_norm={E_norm!r}; allowed: a number >= 0")
    ln, _, lcut = _spd_tail(eigvals, p)
    if E_norm >= ln:
        return math.inf
    return E_norm / (ln * (ln - E_norm)) + 1.0 / (lcut - E_norm) + 1.0 / lcut


def max_noise_std(eigvals: torch.Tensor, p: int) -> float:
    """Largest sigma of :func:`symmetric_noise` that keeps the gap condition: ``min(l_n, delta)/(8 sqrt(n))``.

    ``n`` is ``len(eigvals)``, so pass all n eigenvalues.
    """
    w = torch.as_tensor(eigvals, dtype=torch.float64).flatten()
    ln, lkept, lcut = _spd_tail(w, p)
    return min(ln, lcut - lkept) / (8.0 * math.sqrt(len(w)))


def symmetric_noise(n: int, sigma: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``E = sigma (G + G^T) / sqrt(2)`` with standard Gaussian G (so ``||E|| ~ 2 sigma sqrt(n)``), float64."""
    if not sigma >= 0:
        raise ValueError(f"sigma={sigma!r}; allowed: a number >= 0")
    G = torch.randn(n, n, dtype=torch.float64, generator=generator)
    return sigma * (G + G.T) / math.sqrt(2.0)
