"""Symmetric test matrices and noise draws for the low-rank inverse perturbation study (paper 01).

Each test "batch" is one case: a matrix ``A``, one symmetric Gaussian perturbation ``E`` at a
noise level given as a multiple of the largest level that keeps the gap condition, and the rank p.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lowrank_lit.linalg import is_sparse, max_noise_std, symmetric_noise, to_scipy_sparse

__all__ = ["MatrixDataModule", "REAL_MATRICES", "SYNTHETIC_SPECTRA", "build_matrix", "tail_rule_p"]

D = torch.float64
REAL_MATRICES = ("diabetes", "breast_cancer", "digits_rbf", "hamiltonian")
SYNTHETIC_SPECTRA = ("geometric", "linear", "two_level")
#: p of the card's CPU experiment (section 4) for the bundled real matrices
CARD_P = {"diabetes": 4, "breast_cancer": 4, "digits_rbf": 10, "hamiltonian": 5}
#: p for the synthetic spectra (a tenth of n for the two-level spectrum puts the cut in its gap)
SYNTHETIC_P = {"geometric": 10, "linear": 10}


def _correlation(X: Any) -> torch.Tensor:
    X = torch.as_tensor(X, dtype=D)
    X = (X - X.mean(0)) / X.std(0)
    return X.T @ X / (X.shape[0] - 1)  # (d, d)


def _hamiltonian(n: int = 400) -> torch.Tensor:
    """``-Laplacian_h + V(x)`` on (0, 1), Dirichlet, ``V(x) = 50 (x - 1/2)^2 + 1``, scaled to norm 1."""
    h = 1.0 / (n + 1)
    x = torch.arange(1, n + 1, dtype=D) * h
    H = (2 * torch.eye(n, dtype=D) - torch.diag(torch.ones(n - 1, dtype=D), 1) - torch.diag(torch.ones(n - 1, dtype=D), -1)) / h**2
    H = H + torch.diag(50 * (x - 0.5) ** 2 + 1)
    return H / torch.linalg.matrix_norm(H, ord=2)


def hamiltonian_sparse(n: int) -> Any:
    """The same 1-D Hamiltonian as the bundled ``hamiltonian`` matrix, unscaled, as a sparse tridiagonal
    ``scipy.sparse`` CSC matrix (``-Laplacian_h + 50 (x - 1/2)^2 + 1``): sizes far beyond a dense ``eigh``."""
    import numpy as np
    import scipy.sparse as sp

    if isinstance(n, bool) or not isinstance(n, int) or n < 3:
        raise ValueError(f"hamiltonian_sparse: n={n!r}; allowed: an integer >= 3")
    h = 1.0 / (n + 1)
    x = np.arange(1, n + 1) * h
    main = 2.0 / h**2 + 50.0 * (x - 0.5) ** 2 + 1.0
    off = -np.ones(n - 1) / h**2
    return sp.diags([off, main, off], [-1, 0, 1], format="csc")


def _synthetic(kind: str, n: int, seed: int) -> torch.Tensor:
    if kind == "geometric":
        w = torch.logspace(0, -3, n, dtype=D)
    elif kind == "linear":
        w = torch.linspace(1.0, 0.01, n, dtype=D)
    else:  # two_level: n - n//10 eigenvalues near 1, n//10 near 0.01 (a clear gap at p = n//10)
        k = n // 10
        w = torch.cat([torch.linspace(1.0, 0.9, n - k, dtype=D), torch.linspace(0.012, 0.01, k, dtype=D)])
    Q, _ = torch.linalg.qr(torch.randn(n, n, dtype=D, generator=torch.Generator().manual_seed(seed)))
    return (Q * w) @ Q.T


def build_matrix(name: str, n_synthetic: int = 200, seed: int = 0) -> torch.Tensor:
    """One of :data:`REAL_MATRICES` or :data:`SYNTHETIC_SPECTRA` (float64, symmetric positive definite)."""
    if name == "diabetes":
        from sklearn.datasets import load_diabetes

        return _correlation(load_diabetes().data)
    if name == "breast_cancer":
        from sklearn.datasets import load_breast_cancer

        return _correlation(load_breast_cancer().data)
    if name == "digits_rbf":
        from sklearn.datasets import load_digits
        from sklearn.metrics.pairwise import rbf_kernel

        X = load_digits().data[:300] / 16.0
        K = rbf_kernel(X, gamma=1.0 / (X.shape[1] * X.var()))  # sklearn's "scale" bandwidth (inferred)
        return torch.as_tensor(K, dtype=D) + 0.1 * torch.eye(300, dtype=D)
    if name == "hamiltonian":
        return _hamiltonian(400)
    if name in SYNTHETIC_SPECTRA:
        return _synthetic(name, n_synthetic, seed)
    raise ValueError(f"matrix {name!r}; allowed: {', '.join(REAL_MATRICES + SYNTHETIC_SPECTRA)} or a .npy/.mtx file")


def _load_file(path: str) -> Any:
    """A user's matrix: ``.npy`` (dense), ``.npz`` (``scipy.sparse.save_npz``, kept sparse) or Matrix Market
    ``.mtx`` (kept sparse when stored sparse)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"matrix_files: {path!r} does not exist")
    if p.suffix == ".npy":
        import numpy as np

        return torch.as_tensor(np.load(p), dtype=D)
    if p.suffix == ".npz":
        import scipy.sparse as sp

        return sp.load_npz(p).tocsc().astype("float64")
    if p.suffix == ".mtx":
        import scipy.sparse as sp
        from scipy.io import mmread

        M = mmread(str(p))
        return M.tocsc().astype("float64") if sp.issparse(M) else torch.as_tensor(M, dtype=D)
    raise ValueError(f"matrix_files: {path!r}; allowed: .npy, .npz (scipy sparse) or .mtx files")


def tail_rule_p(eigvals: torch.Tensor, tail: float = 0.05) -> int:
    """Smallest p whose dropped spectral mass of ``A^-1`` is below ``tail``: ``sum_(i>p) 1/l_i / sum_i 1/l_i < tail``.

    (Eigenvalues of A^-1 sorted from the largest; this reading reproduces the card's p = 4 for the
    diabetes and breast-cancer correlation matrices.)
    """
    w = torch.sort(torch.as_tensor(eigvals, dtype=D)).values  # ascending: 1/w descending
    inv = 1.0 / w
    kept = torch.cumsum(inv, 0)
    for p in range(1, len(w)):
        if float((inv.sum() - kept[p - 1]) / inv.sum()) < tail:
            return p
    return len(w) - 1


#: largest sparse matrix the study densifies (a dense n x n eigendecomposition per case)
MAX_DENSE_STUDY = 20000


class MatrixDataModule(pl.LightningDataModule):
    """Cases ``{name, A, eigvals, E, p, noise_multiple, draw}`` for :class:`~lowrank_lit.methods.pinv_bounds.PinvBoundStudy`.

    Args:
        matrices: names from :data:`REAL_MATRICES` and :data:`SYNTHETIC_SPECTRA`. Default: the four real ones.
        matrix_files: your own symmetric positive definite matrices (``.npy``; ``.npz`` from ``scipy.sparse.save_npz``
            or Matrix Market ``.mtx``, read as sparse). Default: [].
        p: rank of the inverse approximation for every matrix; None: the card's p for the bundled real
            matrices, else the 5% tail rule (:func:`tail_rule_p`). Default: None.
        noise_multiples: noise std as multiples of ``max_noise_std`` (the gap-condition limit). Default: [1, 1/8, 1/64].
        draws: noise draws per matrix and level. Default: 10.
        n_synthetic: size of the synthetic matrices. Default: 200.
        seed: seed of the noise draws and synthetic bases. Default: 0.
    """

    def __init__(
        self,
        matrices: list[str] | None = None,
        matrix_files: list[str] | None = None,
        p: int | None = None,
        noise_multiples: list[float] | None = None,
        draws: int = 10,
        n_synthetic: int = 200,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.matrices = list(REAL_MATRICES) if matrices is None else list(matrices)
        self.matrix_files = list(matrix_files or [])
        for name in self.matrices:
            if name not in REAL_MATRICES + SYNTHETIC_SPECTRA:
                raise ValueError(f"MatrixDataModule: matrices contains {name!r}; allowed: "
                                 f"{', '.join(REAL_MATRICES + SYNTHETIC_SPECTRA)}")
        self.noise_multiples = [1.0, 1 / 8, 1 / 64] if noise_multiples is None else list(noise_multiples)
        if any(not m > 0 for m in self.noise_multiples):
            raise ValueError(f"MatrixDataModule: noise_multiples={self.noise_multiples}; allowed: numbers > 0")
        if draws < 1:
            raise ValueError(f"MatrixDataModule: draws={draws}; allowed: an integer >= 1")
        self.p, self.draws, self.n_synthetic, self.seed = p, draws, n_synthetic, seed
        self.cases: list[dict[str, Any]] = []

    def setup(self, stage: str | None = None) -> None:
        if self.cases:
            return
        named = [(m, build_matrix(m, self.n_synthetic, self.seed)) for m in self.matrices]
        named += [(Path(f).stem, _load_file(f)) for f in self.matrix_files]
        g = torch.Generator().manual_seed(self.seed)
        for name, A in named:
            if is_sparse(A):
                # the study measures the actual error with dense eigendecompositions of A and A + E
                if A.shape[0] > MAX_DENSE_STUDY:
                    raise ValueError(
                        f"MatrixDataModule: {name} is {A.shape[0]} x {A.shape[0]}; the study (actual error vs bounds) "
                        f"needs dense eigendecompositions, allowed up to n = {MAX_DENSE_STUDY}; for the bounds alone call "
                        "lowrank_lit.methods.pinv_bounds.contour_bound(A, E_norm, p) on the sparse matrix"
                    )
                A = torch.as_tensor(to_scipy_sparse(A, name).toarray(), dtype=D)
            w = torch.linalg.eigvalsh(A)
            p = self.p or CARD_P.get(name) or SYNTHETIC_P.get(name)
            if p is None:
                p = A.shape[0] // 10 if name == "two_level" else tail_rule_p(w)
            sigma_max = max_noise_std(w, p)
            for mult in self.noise_multiples:
                for d in range(self.draws):
                    E = symmetric_noise(A.shape[0], mult * sigma_max, g)
                    self.cases.append({"name": name, "A": A, "eigvals": w, "E": E, "p": p,
                                       "noise_multiple": mult, "draw": d})

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.cases, batch_size=None, shuffle=False, collate_fn=lambda case: case)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()
