"""EAGLE vs gradient descent: iterations to a relative error of 1e-10 on the Nyström completion D* = B A^+ C.

    python benchmarks/eagle_iterations.py [--n 50] [--kappas 1e2 1e3 1e4] [--gd-max 100000] [--seeds 0 1 2]

A (n x n) has singular values log-spaced from 1 to 1/kappa, B = W A (2 rows), C (n x 2); float64. Rows:
centralised EAGLE (eta = 1/3, gamma = 1), gradient descent on W (step 1/sigma_max^2, capped at --gd-max
iterations, ">" when the cap is hit), distributed EAGLE with M = 3 machines each holding an n x n block of a
(n x 3n) A (every machine full row rank, diversity index 1) against centralised EAGLE on the same A, and
sketched EAGLE with r = n/4 (a fresh random orthonormal sketch each step) against centralised. Prints the
iteration counts (median over seeds) and the ratios against centralised EAGLE in the same run.

``--sketch-sweep`` instead measures where the sketched iterations go: iterations of sketched EAGLE against
centralised EAGLE for r = n/8 ... n, at two tolerances (1e-4 and 1e-10), with a fresh orthonormal sketch each
step (the default) and with a fresh random coordinate subset (r columns of the identity), kappa 1e2.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.linalg import eagle_solve, gd_solve, iterations_to


def problem(kappa: float, d: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))[0]
    A = u @ torch.diag(torch.logspace(0, -math.log10(kappa), d, dtype=torch.float64)) @ v.T
    return A, torch.randn(2, d, generator=g, dtype=torch.float64) @ A, torch.randn(d, 2, generator=g, dtype=torch.float64)


def count(errors: list[float], every: int = 1) -> float:
    it = iterations_to(errors, 1e-10, every)
    return float("inf") if it is None else float(it)


def sketched(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, r: int, kind: str, seed: int, iters: int) -> list[float]:
    """Relative errors of sketched EAGLE with a fresh ``(n, r)`` sketch each step: ``orthonormal`` (QR of a
    Gaussian, as :func:`eagle_solve`) or ``coordinates`` (r distinct columns of the identity)."""
    if kind == "orthonormal":
        return eagle_solve(A, B, C, iters=iters, sketch=r, tol=None, generator=torch.Generator().manual_seed(seed))["errors"]
    from lowrank_lit.linalg import _eagle_block, nystrom_target

    g = torch.Generator().manual_seed(seed)
    n = A.shape[-1]
    target = nystrom_target(A, B, C)
    scale = torch.linalg.matrix_norm(target)
    D = torch.zeros(B.shape[-2], C.shape[-1], dtype=torch.float64)
    errors = []
    for _ in range(iters):
        S = torch.eye(n, dtype=torch.float64)[:, torch.randperm(n, generator=g)[:r]]  # (n, r)
        A, B, C, D = _eagle_block(A, B, C, D, 1.0 / 3.0, 1.0, S)
        errors.append(float(torch.linalg.matrix_norm(D - target) / scale))
    return errors


def sketch_sweep(n: int, seeds: list[int]) -> None:
    print(f"sketched / centralised EAGLE iterations, n = {n}, kappa 1e2 (median over seeds {seeds}); "
          "centralised iterations in brackets")
    print("| r | n / r | sketch | to 1e-4 | to 1e-10 | ratio at 1e-4 | ratio at 1e-10 |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted({max(1, n // 8), max(1, n // 4), max(1, n // 2), n}):
        for kind in ("orthonormal", "coordinates"):
            cells = {1e-4: [], 1e-10: []}
            central = {1e-4: [], 1e-10: []}
            for seed in seeds:
                A, B, C = problem(1e2, n, n, seed)
                ce = eagle_solve(A, B, C, iters=200)["errors"]
                se = sketched(A, B, C, r, kind, seed, 40_000)
                for tol in cells:
                    cells[tol].append(float(iterations_to(se, tol) or math.inf))
                    central[tol].append(float(iterations_to(ce, tol) or math.inf))
            med = {t: statistics.median(v) for t, v in cells.items()}
            cen = {t: statistics.median(v) for t, v in central.items()}
            print(f"| {r} | {n / r:g} | {kind} | {med[1e-4]:.0f} ({cen[1e-4]:.0f}) | {med[1e-10]:.0f} ({cen[1e-10]:.0f}) | "
                  f"{med[1e-4] / cen[1e-4]:.1f} | {med[1e-10] / cen[1e-10]:.1f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--kappas", type=float, nargs="+", default=[1e2, 1e3, 1e4])
    p.add_argument("--gd-max", type=int, default=100_000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sketch-sweep", action="store_true", help="iterations of sketched EAGLE against r and the tolerance")
    args = p.parse_args()
    if args.sketch_sweep:
        sketch_sweep(args.n, args.seeds)
        return
    n, r = args.n, max(1, args.n // 4)
    print(f"iterations to relative error 1e-10 (median over seeds {args.seeds}), n = {n}")
    print("| kappa | EAGLE | GD | GD / EAGLE | EAGLE on n x 3n | distributed M = 3 | M = 3 / central | sketched r = n/4 | sketched / central | n / r |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kappa in args.kappas:
        e, gd, c3, m3, sk = [], [], [], [], []
        for seed in args.seeds:
            A, B, C = problem(kappa, n, n, seed)
            e.append(count(eagle_solve(A, B, C, iters=200)["errors"]))
            every = 100
            gd.append(count(gd_solve(A, B, C, iters=args.gd_max, tol=1e-10, record_every=every)["errors"], every))
            sk.append(count(eagle_solve(A, B, C, iters=20_000, sketch=r, tol=None,
                                        generator=torch.Generator().manual_seed(seed))["errors"]))
            A3, B3, C3 = problem(kappa, n, 3 * n, seed)
            c3.append(count(eagle_solve(A3, B3, C3, iters=200)["errors"]))
            m3.append(count(eagle_solve(A3, B3, C3, iters=2000, machines=3)["errors"]))
        med = {k: statistics.median(v) for k, v in (("e", e), ("gd", gd), ("c3", c3), ("m3", m3), ("sk", sk))}
        gd_cell = f"> {args.gd_max}" if math.isinf(med["gd"]) else f"{med['gd']:.0f}"
        gd_ratio = f"> {args.gd_max / med['e']:.0f}" if math.isinf(med["gd"]) else f"{med['gd'] / med['e']:.0f}"
        print(f"| {kappa:.0e} | {med['e']:.0f} | {gd_cell} | {gd_ratio} | {med['c3']:.0f} | {med['m3']:.0f} | "
              f"{med['m3'] / med['c3']:.2f} | {med['sk']:.0f} | {med['sk'] / med['e']:.1f} | {n / r:.0f} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
