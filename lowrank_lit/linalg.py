"""Shared low-rank linear algebra (float64 where bounds need it)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = [
    "check_symmetric", "is_sparse", "max_noise_std", "smallest_eigenpairs", "spd_tail", "spectral_norm_sym",
    "symmetric_noise", "to_scipy_sparse", "eagle_solve", "gd_solve", "nystrom_target", "iterations_to",
    "entropy_rank", "stable_rank",
]


def entropy_rank(sigma: torch.Tensor) -> float:
    """Effective rank of singular values ``sigma`` (Roy and Vetterli): ``exp(-sum p_i log p_i)``, ``p = sigma / sum
    sigma``; between 1 (one direction) and the number of nonzero values (a flat spectrum); 0 for a zero matrix."""
    total = sigma.sum()
    if float(total) <= 0:
        return 0.0
    p = sigma / total
    return float(torch.exp(-(p * torch.log(p.clamp_min(1e-12))).sum()))


def stable_rank(sigma: torch.Tensor) -> float:
    """``||W||_F^2 / ||W||_2^2 = sum sigma_i^2 / sigma_max^2`` (0 for a zero matrix)."""
    top = float(sigma.max()) if sigma.numel() else 0.0
    return float(sigma.pow(2).sum()) / top**2 if top > 0 else 0.0


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


# --------------------------------------------------------------------------------------- EAGLE
def _check_eagle(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, eta: float, gamma: float) -> None:
    if A.ndim < 2 or B.shape[:-2] != A.shape[:-2] or C.shape[:-2] != A.shape[:-2]:
        raise ValueError(f"eagle_solve: A (..., d, n), B (..., d', n), C (..., d, n') with equal batch shapes; got "
                         f"{tuple(A.shape)}, {tuple(B.shape)}, {tuple(C.shape)}")
    if B.shape[-1] != A.shape[-1] or C.shape[-2] != A.shape[-2]:
        raise ValueError(f"eagle_solve: B must have A's n = {A.shape[-1]} columns and C A's d = {A.shape[-2]} rows; "
                         f"got B {tuple(B.shape)}, C {tuple(C.shape)}")
    if not (eta > 0 and gamma > 0):
        raise ValueError(f"eagle_solve: eta={eta}, gamma={gamma}; allowed: floats > 0")
    for name, t in (("A", A), ("B", B), ("C", C)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"eagle_solve: {name} has NaN or inf entries")


def _eagle_block(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, eta: float, gamma: float,
                 S: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """One EAGLE step on one block: returns the new ``(A, B, C, D)`` (all updates use the old values)."""
    At = A if S is None else A @ S  # (..., d, r)
    Bt = B if S is None else B @ S  # (..., d', r)
    norm = torch.linalg.matrix_norm(At, ord=2)  # (...,)
    if bool((norm == 0).any()):
        raise ValueError("eagle_solve: A (or A S) has zero spectral norm; the step size 1 / ||A||^2 is undefined")
    rho = (1.0 / norm**2)[..., None, None]
    gram = At.transpose(-1, -2) @ At  # (..., r, r)
    right = gram if S is None else gram @ S.transpose(-1, -2)  # Ã^T Ã S^T: (..., r, n)
    AtC = At.transpose(-1, -2) @ C  # (..., r, n')
    return (A - eta * rho * (At @ right), B - eta * rho * (Bt @ right),
            C - gamma * rho * (At @ AtC), D + gamma * rho * (Bt @ AtC))


def nystrom_target(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """``D* = B A^+ C`` (float64 pseudo-inverse): what EAGLE converges to."""
    A, B, C = (t.double() for t in (A, B, C))
    return B @ torch.linalg.pinv(A) @ C


def eagle_solve(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, iters: int = 50, eta: float = 1.0 / 3.0,
                gamma: float = 1.0, sketch: int | None = None, machines: int | None = None, tol: float | None = None,
                target: torch.Tensor | None = None, generator: torch.Generator | None = None) -> dict[str, Any]:
    """EAGLE: estimate the Nyström completion ``D* = B A^+ C`` by second-order iterations (float64, batched).

    With ``Ã = A S``, ``B̃ = B S`` and ``rho = ||Ã||_2^-2``, each step is::

        A <- A - eta rho Ã Ã^T Ã S^T        C <- C - gamma rho Ã Ã^T C
        B <- B - eta rho B̃ Ã^T Ã S^T        D <- D + gamma rho B̃ Ã^T C

    (``D_0 = 0``). ``B - W* A`` and ``D + W* C`` stay invariant (``W* = B A^+``), the A-update is a
    Newton-Schulz conditioning loop, so ``C -> 0`` and ``D -> D*``.

    Args:
        A: ``(..., d, n)``; B: ``(..., d', n)``; C: ``(..., d, n')``.
        iters: most iterations. Default: 50.
        eta, gamma: step constants (theory: 1/3 and 1; the trained transformer: ~1 and ~1.9). Default: 1/3, 1.
        sketch: r: multiply by a fresh ``(n, r)`` random orthonormal S every step (compute-limited); None: S = I.
        machines: M: split the n columns of A and B into M equal blocks, step each block with the shared C, D
            and average C and D (distributed); None: centralised. M = 1 equals centralised bit for bit.
        tol: stop when ``||D_l - D_{l-1}||_F < tol`` (every batch element); None: run ``iters`` steps.
        target: ``D*`` for the error history; None computes it with a pseudo-inverse.
        generator: random source of the sketches.

    Returns:
        ``{"D": (..., d', n'), "iters": steps taken, "errors": [relative error ||D - D*||_F / ||D*||_F (max over
        the batch) after each step], "A", "B", "C"}``.

    Raises:
        ValueError: shapes that do not fit, ``eta``/``gamma`` <= 0, non-finite input, A = 0, M not dividing n,
            ``sketch`` outside [1, n].
    """
    _check_eagle(A, B, C, eta, gamma)
    A, B, C = A.double(), B.double(), C.double()
    n = A.shape[-1]
    if machines is not None and (machines < 1 or n % machines):
        raise ValueError(f"eagle_solve: machines={machines} must be >= 1 and divide n = {n}")
    if sketch is not None and not 1 <= sketch <= n:
        raise ValueError(f"eagle_solve: sketch={sketch}; allowed: 1 <= r <= n = {n}")
    if target is None:
        target = nystrom_target(A, B, C)
    target = target.double()
    scale = torch.linalg.matrix_norm(target).clamp_min(1e-300)
    D = torch.zeros(*A.shape[:-2], B.shape[-2], C.shape[-1], dtype=torch.float64)
    errors: list[float] = []
    steps = 0
    for _ in range(int(iters)):
        previous = D
        if machines is None:
            S = None
            if sketch is not None:
                S = torch.linalg.qr(torch.randn(n, sketch, dtype=torch.float64, generator=generator))[0]  # (n, r)
            A, B, C, D = _eagle_block(A, B, C, D, eta, gamma, S)
        else:
            blocks = [_eagle_block(a, b, C, D, eta, gamma, None)
                      for a, b in zip(A.chunk(machines, -1), B.chunk(machines, -1), strict=True)]
            A = torch.cat([blk[0] for blk in blocks], -1)
            B = torch.cat([blk[1] for blk in blocks], -1)
            C = torch.stack([blk[2] for blk in blocks]).sum(0) / machines
            D = torch.stack([blk[3] for blk in blocks]).sum(0) / machines
        steps += 1
        errors.append(float((torch.linalg.matrix_norm(D - target) / scale).max()))
        if tol is not None and float(torch.linalg.matrix_norm(D - previous).max()) < tol:
            break
    return {"D": D, "iters": steps, "errors": errors, "A": A, "B": B, "C": C}


def gd_solve(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, iters: int = 10_000, tol: float | None = None,
             target: torch.Tensor | None = None, record_every: int = 1) -> dict[str, Any]:
    """Gradient-descent baseline: ``W <- W - (W A - B) A^T / sigma_max(A)^2``, ``D = W C`` (float64).

    Returns ``{"D", "iters", "errors"}`` like :func:`eagle_solve` (``errors`` every ``record_every`` steps); stops
    when the relative error drops below ``tol``.
    """
    _check_eagle(A, B, C, 1.0, 1.0)
    A, B, C = A.double(), B.double(), C.double()
    if target is None:
        target = nystrom_target(A, B, C)
    scale = torch.linalg.matrix_norm(target).clamp_min(1e-300)
    step = 1.0 / torch.linalg.matrix_norm(A, ord=2)[..., None, None] ** 2
    W = torch.zeros(*A.shape[:-2], B.shape[-2], A.shape[-2], dtype=torch.float64)
    AAt, BAt = A @ A.transpose(-1, -2), B @ A.transpose(-1, -2)
    errors, steps = [], 0
    for i in range(int(iters)):
        W = W - step * (W @ AAt - BAt)
        steps = i + 1
        if steps % record_every == 0 or steps == iters:
            err = float((torch.linalg.matrix_norm(W @ C - target) / scale).max())
            errors.append(err)
            if tol is not None and err < tol:
                break
    return {"D": W @ C, "iters": steps, "errors": errors}


def iterations_to(errors: list[float], tol: float, every: int = 1) -> int | None:
    """First iteration (1-based) whose error is below ``tol`` (``every``: spacing of the recorded errors); None if never."""
    for i, e in enumerate(errors):
        if e < tol:
            return (i + 1) * every
    return None
