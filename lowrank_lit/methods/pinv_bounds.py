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
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch

from lowrank_lit.linalg import (
    check_symmetric,
    is_sparse,
    max_noise_std,
    smallest_eigenpairs,
    spd_tail,
    spectral_norm_sym,
    symmetric_noise,
)
from lowrank_lit.registry import register_method
from lowrank_lit.report import artifact_path, log_image, may_write, new_figure, save_figure, save_rows

__all__ = [
    "best_rank_p_inverse",
    "lowrank_inverse_error",
    "contour_bound",
    "eym_neumann_bound",
    "gap_condition_holds",
    "max_noise_std",
    "symmetric_noise",
    "PinvBoundStudy",
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


def _smallest(eigvals: Any, p: int) -> Any:
    """Eigenvalues as given, or the p+1 smallest of a matrix (dense 2-D or sparse) via shift-invert Lanczos."""
    if is_sparse(eigvals) or (isinstance(eigvals, torch.Tensor) and eigvals.ndim == 2):
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"p={p!r}; allowed: an integer >= 1 (the bounds need lambda_(n-p))")
        return smallest_eigenpairs(eigvals, p + 1)[0]
    return eigvals


def gap_condition_holds(eigvals: torch.Tensor, E_norm: float, p: int) -> bool:
    """``4 ||E|| <= min(lambda_n, delta_{n-p})``."""
    if not E_norm >= 0:
        raise ValueError(f"E_norm={E_norm!r}; allowed: a number >= 0")
    ln, lkept, lcut = spd_tail(_smallest(eigvals, p), p)
    return 4.0 * E_norm <= min(ln, lcut - lkept)


def contour_bound(eigvals: Any, E_norm: float, p: int) -> float:
    """Theorem 2.1: ``4||E||/l_n^2 + 5||E||/(l_{n-p} delta_{n-p})``.

    Args:
        eigvals: eigenvalues of A (all, or at least the p+1 smallest), or A itself (dense, ``scipy.sparse`` or a
            torch sparse tensor: its p+1 smallest eigenvalues come from shift-invert Lanczos).
        E_norm: spectral norm of the perturbation.
        p: rank of the inverse approximation, 1 <= p < n.

    Raises:
        ValueError: the gap condition fails (the bound does not apply), delta_{n-p} = 0 (rank-p
            inverse not unique), A not positive definite, or bad p / E_norm.
    """
    eigvals = _smallest(eigvals, p)
    ln, lkept, lcut = spd_tail(eigvals, p)
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
    ln, _, lcut = spd_tail(_smallest(eigvals, p), p)
    if E_norm >= ln:
        return math.inf
    return E_norm / (ln * (ln - E_norm)) + 1.0 / (lcut - E_norm) + 1.0 / lcut


# --------------------------------------------------------------------------------------- study driver
def _slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = torch.log(torch.tensor(x, dtype=torch.float64)), torch.log(torch.tensor(y, dtype=torch.float64))
    lx = lx - lx.mean()
    return float((lx * (ly - ly.mean())).sum() / (lx * lx).sum())


@register_method("pinv_bounds", kind="Analysis", paper="Perturbation Bounds for Low-Rank Inverse Approximations under Noise", bench="bench")
class PinvBoundStudy(pl.LightningModule):
    """Parameter-free LightningModule: ``lowrank test --config configs/pinv_bounds/<x>.yaml``.

    Each test batch is one case from :class:`~lowrank_lit.data.matrices.MatrixDataModule` (a dict with
    ``A``, ``E``, ``p``, ``name``, ``noise_multiple`` and optionally A's ``eigvals``). Per case it
    logs the actual error, both bounds, their ratios to the error and whether the gap condition
    holds; at the end it prints a table per (matrix, noise level), the log-log slopes of error and
    bounds against ``||E||``, the number of bound violations, and saves ``pinv_bounds.csv`` and
    ``pinv_bounds.png`` (error and bounds vs ``||E||``, one panel per matrix) in the run directory
    (and the plot to W&B).

    Args:
        plot: save the log-log plot. Default: True.
    """

    sharding_refusal: ClassVar[str | None] = "a numerical study of matrix bounds (lowrank test); it has no trained weights to shard"

    def __init__(self, plot: bool = True) -> None:
        super().__init__()
        self.plot = plot
        self.rows: list[dict[str, float | str | bool]] = []

    def test_step(self, case: dict, batch_idx: int) -> None:
        A, E, p = case["A"], case["E"], int(case["p"])
        w = case["eigvals"] if "eigvals" in case else torch.linalg.eigvalsh(A)  # shared by all draws of A
        e_norm = spectral_norm_sym(E)
        err = lowrank_inverse_error(A, E, p)
        holds = gap_condition_holds(w, e_norm, p)
        contour = contour_bound(w, e_norm, p) if holds else math.nan
        eym = eym_neumann_bound(w, e_norm, p)
        row = {"matrix": case["name"], "n": A.shape[0], "p": p, "noise_multiple": float(case["noise_multiple"]),
               "E_norm": e_norm, "error": err, "contour": contour, "eym_n": eym, "gap_holds": holds,
               "violation": bool(holds and err > contour * (1 + 1e-9))}
        self.rows.append(row)
        self.log_dict({"case/error": err, "case/E_norm": e_norm, "case/gap_holds": float(holds),
                       "case/contour_ratio": contour / err if holds else math.nan,
                       "case/eym_ratio": eym / err}, batch_size=1)

    def summary(self) -> tuple[list[dict], dict[str, dict[str, float]]]:
        """Mean per (matrix, noise level) and the log-log slopes per matrix."""
        groups: dict[tuple[str, float], list[dict]] = {}
        for r in self.rows:
            groups.setdefault((str(r["matrix"]), float(r["noise_multiple"])), []).append(r)
        table = []
        for (name, mult), rs in groups.items():
            mean = {k: sum(float(r[k]) for r in rs) / len(rs) for k in ("E_norm", "error", "contour", "eym_n")}
            table.append({"matrix": name, "p": rs[0]["p"], "noise_multiple": mult, **mean,
                          "gap_holds": all(bool(r["gap_holds"]) for r in rs),
                          "violations": sum(bool(r["violation"]) for r in rs), "draws": len(rs)})
        slopes = {}
        for name in dict.fromkeys(str(t["matrix"]) for t in table):
            ts = [t for t in table if t["matrix"] == name]
            if len(ts) < 2:
                continue
            slopes[name] = {}
            for k in ("error", "contour", "eym_n"):  # over the levels where the quantity is defined
                pts = [(float(t["E_norm"]), float(t[k])) for t in ts if math.isfinite(float(t[k])) and float(t[k]) > 0]
                if len(pts) >= 2:
                    slopes[name][k] = _slope([a for a, _ in pts], [b for _, b in pts])
        return table, slopes

    def on_test_epoch_end(self) -> None:
        table, slopes = self.summary()
        violations = sum(int(t["violations"]) for t in table)
        self.log("pinv/violations", float(violations))
        for name, s in slopes.items():
            for k, v in s.items():
                self.log(f"pinv/{name}/slope_{k}", v)
        if self.trainer.is_global_zero and table:
            self._report(table, slopes, violations)
        self.rows = []

    def _report(self, table: list[dict], slopes: dict, violations: int) -> None:
        print(f"{'matrix':14s} {'p':>3s} {'sigma/max':>9s} {'||E||':>9s} {'error':>9s} {'contour':>9s} "
              f"{'EYM-N':>9s} {'cont/err':>8s} {'eym/err':>8s} gap  viol")
        for t in table:
            cr = t["contour"] / t["error"] if math.isfinite(t["contour"]) else math.nan
            print(f"{t['matrix']:14s} {t['p']:3d} {t['noise_multiple']:9.4g} {t['E_norm']:9.3g} {t['error']:9.3g} "
                  f"{t['contour']:9.3g} {t['eym_n']:9.3g} {cr:8.3g} {t['eym_n'] / t['error']:8.3g} "
                  f"{'yes' if t['gap_holds'] else 'no ':4s} {t['violations']}")
        for name, s in slopes.items():
            print(f"slopes vs ||E|| {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))
        print(f"bound violations: {violations}")
        if not may_write(self.trainer):
            return
        save_rows(self.trainer, table, "pinv_bounds.csv")
        if self.plot:
            path = artifact_path(self.trainer, "pinv_bounds.png")
            _plot_study(table, path)
            log_image(self.trainer, "pinv/plot", path)


def _plot_study(table: list[dict], path: str) -> None:

    names = list(dict.fromkeys(t["matrix"] for t in table))
    fig, axes = new_figure(1, len(names), figsize=(3.2 * len(names), 3.0), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        ts = sorted((t for t in table if t["matrix"] == name), key=lambda t: t["E_norm"])
        x = [t["E_norm"] for t in ts]
        ax.loglog(x, [t["error"] for t in ts], "o-", label="actual")
        ax.loglog(x, [t["contour"] for t in ts], "s-", label="contour (Thm 2.1)")
        ax.loglog(x, [t["eym_n"] for t in ts], "^-", label="EYM-N")
        ax.set_title(f"{name} (p={ts[0]['p']})")
        ax.set_xlabel("||E||")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("||(A+E)^-1_p - A_p^-1||")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def bench(ctx: Any) -> list[Any]:
    """Cost of the low-rank inverse through shift-invert Lanczos (p smallest eigenpairs) against a full dense
    eigendecomposition (``lowrank bench pinv_bounds``)."""
    from lowrank_lit.bench import ratio_row
    from lowrank_lit.linalg import smallest_eigenpairs

    n, p = ctx.size(1000, 300), 10
    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    A = (q * torch.logspace(0, 3, n, dtype=torch.float64)) @ q.T
    times = ctx.compare({"lanczos": lambda: smallest_eigenpairs(A, p), "eigh": lambda: torch.linalg.eigh(A)},
                        ctx.rounds(5, 2), warmup=1)
    return [ratio_row(ctx, "pinv_bounds", f"p = {p} smallest eigenpairs (shift-invert Lanczos), n = {n}",
                      "full eigendecomposition (torch.linalg.eigh)", times, "lanczos", "eigh", "reported (float64)")]
