"""Shared low-rank linear algebra (float64 where bounds need it)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = [
    "check_symmetric", "is_sparse", "max_noise_std", "smallest_eigenpairs", "spd_tail", "spectral_norm_sym",
    "symmetric_noise", "to_scipy_sparse",
]


def check_symmetric(A: torch.Tensor, name: str = "A", rtol: float = 1e-10) -> torch.Tensor:
    """Return ``A`` as float64 after checking it is a finite, square, symmetric 2-D tensor.

    Raises:
        ValueError: naming ``name`` when A is not 2-D square, has NaN/Inf, or ``|A - A^T| > rtol * |A|``.
    """
    A = torch.as_tensor(A)
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(A.shape)}")
    A = A.to(torch.float64)
    if not torch.isfinite(A).all():
        raise ValueError(f"{name} has NaN or Inf entries")
    # Frobenius norm: an O(n^2) upper bound of the spectral norm (an SVD here would cost more than the bound)
    scale = float(torch.linalg.matrix_norm(A)) if A.numel() else 0.0
    if float((A - A.T).abs().max()) > rtol * max(scale, 1e-300):
        raise ValueError(f"{name} must be symmetric (|{name} - {name}^T| > {rtol:g} * |{name}|)")
    return A


def is_sparse(A: Any) -> bool:
    """Whether ``A`` is a ``scipy.sparse`` matrix/array or a torch sparse tensor."""
    if isinstance(A, torch.Tensor):
        return A.layout != torch.strided
    return type(A).__module__.startswith("scipy.sparse")


def to_scipy_sparse(A: Any, name: str = "A") -> Any:
    """A sparse symmetric matrix as ``scipy.sparse`` CSC float64, checked square, finite and symmetric.

    Accepts ``scipy.sparse`` matrices/arrays and torch sparse tensors (COO, CSR, CSC).

    Raises:
        ValueError: naming ``name`` when it is not square, has NaN/Inf or is not symmetric.
    """
    import scipy.sparse as sp

    if isinstance(A, torch.Tensor):
        coo = A.to_sparse_coo().coalesce()
        idx, vals = coo.indices().numpy(), coo.values().to(torch.float64).numpy()
        A = sp.coo_matrix((vals, (idx[0], idx[1])), shape=tuple(coo.shape))
    M = sp.csc_matrix(A, dtype=np.float64)
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(M.shape)}")
    if not np.isfinite(M.data).all():
        raise ValueError(f"{name} has NaN or Inf entries")
    scale = float(np.sqrt((M.data**2).sum())) if M.nnz else 0.0
    diff = abs(M - M.T)
    if diff.nnz and float(diff.max()) > 1e-10 * max(scale, 1e-300):
        raise ValueError(f"{name} must be symmetric (|{name} - {name}^T| > 1e-10 * |{name}|)")
    return M


def smallest_eigenpairs(A: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` eigenpairs of symmetric ``A`` with the smallest ``|lambda|`` (ascending ``|lambda|``).

    Dense positive definite ``A`` (checked with a Cholesky factorization): LAPACK's ``dsyevr`` restricted
    to the k smallest eigenvalues (``scipy.linalg.eigh(subset_by_index=...)``), which skips most of a
    full ``eigh``. Dense indefinite ``A``: ARPACK's shift-invert Lanczos around 0 (``eigsh(sigma=0)``).
    Small dense matrices use ``eigh``. Sparse ``A`` (``scipy.sparse`` or a torch sparse tensor):
    shift-invert Lanczos around 0 on a sparse LU factorization (SuperLU), so the cost follows the
    factorization's fill-in, about linear in n for banded matrices such as a tridiagonal Hamiltonian.

    Returns:
        ``(eigvals (k,), eigvecs (n, k))`` in float64.
    """
    if is_sparse(A):
        from scipy.sparse.linalg import eigsh

        M = to_scipy_sparse(A)
        n = M.shape[0]
        if not 1 <= k < n - 1:
            raise ValueError(f"k={k}; allowed: 1 <= k < n - 1 = {n - 1} for a sparse A")
        w, V = eigsh(M, k=k, sigma=0.0, which="LM", v0=np.ones(n))
        order = np.argsort(np.abs(w), kind="stable")
        return torch.from_numpy(w[order].copy()), torch.from_numpy(V[:, order].copy())
    A = check_symmetric(A)
    n = A.shape[0]
    if not 1 <= k < n:
        raise ValueError(f"k={k}; allowed: 1 <= k < n = {n}")
    if n <= 64 or k >= n // 2:
        w, V = torch.linalg.eigh(A)
        order = torch.argsort(w.abs())[:k]
        return w[order], V[:, order]
    if int(torch.linalg.cholesky_ex(A).info) == 0:  # positive definite: smallest |lambda| = smallest lambda
        from scipy.linalg import eigh

        w, V = eigh(A.numpy(), subset_by_index=[0, k - 1], driver="evr")
        return torch.from_numpy(w), torch.from_numpy(V)
    from scipy.sparse.linalg import eigsh

    w, V = eigsh(A.numpy(), k=k, sigma=0.0, which="LM")
    order = np.argsort(np.abs(w))
    return torch.from_numpy(w[order].copy()), torch.from_numpy(V[:, order].copy())


def spectral_norm_sym(A: torch.Tensor) -> float:
    """Spectral norm of a symmetric matrix (largest ``|eigenvalue|``)."""
    return float(torch.linalg.eigvalsh(A.to(torch.float64)).abs().max())


def spd_tail(eigvals: Any, p: int) -> tuple[float, float, float]:
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


def max_noise_std(eigvals: torch.Tensor, p: int) -> float:
    """Largest sigma of :func:`symmetric_noise` that keeps the gap condition: ``min(l_n, delta)/(8 sqrt(n))``.

    ``n`` is ``len(eigvals)``, so pass all n eigenvalues.
    """
    w = torch.as_tensor(eigvals, dtype=torch.float64).flatten()
    ln, lkept, lcut = spd_tail(w, p)
    return min(ln, lcut - lkept) / (8.0 * math.sqrt(len(w)))


def symmetric_noise(n: int, sigma: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``E = sigma (G + G^T) / sqrt(2)`` with standard Gaussian G (so ``||E|| ~ 2 sigma sqrt(n)``), float64."""
    if not sigma >= 0:
        raise ValueError(f"sigma={sigma!r}; allowed: a number >= 0")
    G = torch.randn(n, n, dtype=torch.float64, generator=generator)
    return sigma * (G + G.T) / math.sqrt(2.0)
