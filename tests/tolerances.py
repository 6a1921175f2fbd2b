"""The tolerances of float comparisons in the test suite, each with the error analysis it comes from.

Every ``atol=`` / ``rtol=`` / ``abs=`` / ``rel=`` in tests/ is ``0``, one of the names below (or an expression of
them), or carries a ``# tol:`` comment on its line that says where the number comes from (an approximation of the
method itself, a Monte-Carlo or finite-difference error, a pinned spread); ``tests/test_stats.py`` checks this.

Why names: a tolerance copied from one machine's result breaks on the next machine. Torch's CPU kernels
(``ATEN_CPU_CAPABILITY=default | avx2 | avx512``), MKL / oneDNN paths and the thread count change the order in
which a sum is accumulated, and with it the last bits of every float32 reduction. Two evaluations of the same
function by different code paths (a merged and an unmerged adapter, a fast and a reference implementation, an
export and its source) differ by that rounding, never by more, so each tolerance is a bound on rounding:

- summing ``n`` terms of magnitude ``<= s`` in two different orders differs by at most ``2 (n - 1) eps s`` (the
  worst case; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 3.1) and typically by about
  ``sqrt(n) eps s`` (rounding errors of random sign, sec. 2.8);
- through ``L`` layers the per-layer errors add (the layers of these small models are not expansive: LayerNorm and
  softmax renormalise, weights are initialised with unit gain);
- a factor of 10 over the typical bound covers the tails; a wrong formula moves the outputs by O(1e-2) or more.

Where a comparison runs through a whole pretrained network in float32 (the six BERT layers of MiniLM, width 384),
the tests compare in float64 instead, which removes the kernel dependence (see test_artifacts.py).

A comparison without a tolerance uses the library's default for its dtype (``torch.testing.assert_close``: float32
rtol 1.3e-6 and atol 1e-5, float64 rtol 1e-7 and atol 1e-7; ``pytest.approx``: rel 1e-6), which the suite uses
only for elementwise results and short reductions, the F32 class below.
"""

from __future__ import annotations

import math

import torch

#: float32 unit roundoff (2^-23 = 1.19e-7) and float64 (2^-52 = 2.2e-16)
EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps

#: float64 hand cases, closed forms, decompositions (SVD, QR, eigh, Cholesky, solves) of matrices up to 100 x 100
#: with condition number up to 1e4, and fixed-point iterations run to convergence: the worst-case reduction error
#: 2 n eps64 is 4.4e-14 for n = 100, a backward-stable decomposition adds n eps64 cond = 2.2e-10 at cond 1e4.
#: 1e-8 covers both with a factor of 40; it is 10^6 below any error a wrong formula makes.
F64 = 1e-8

#: float32 elementwise arithmetic and reductions of up to ~64 terms of magnitude <= 1 (norms of small vectors,
#: softmax over a few classes, a 3 x 3 rotation, a rank-r product with r <= 16, one optimizer step): the typical
#: two-order difference is sqrt(64) eps32 = 9.5e-7; worst-case 2 x 63 x eps32 = 1.5e-5 is never reached by random
#: data, and a kernel change only reorders the sum. 1e-6 also covers ~8 ulps of elementwise chains (exp, log,
#: atan2: each within 1-2 ulps).
F32 = 1e-6

#: float32 through one to three layers of width <= 512 (a small CNN or MLP forward, a BERT embedding plus one
#: attention layer, statistics over a batch of feature maps): 10 x 3 x sqrt(512) x eps32 = 8.1e-5 typical-bound,
#: measured 1.3e-6 to 2.3e-6 across the kernels and thread counts of tests/test_pinned.py's spread script for two
#: BERT layers at width 384. 1e-5 sits between the measured spread (x4) and the bound.
F32_LAYERS = 1e-5

#: float32 through a deep or wide network (the six BERT layers of MiniLM at width 384, hidden values up to 8, or a
#: sum of up to 10^4 products): 10 x 6 x sqrt(384) x eps32 x 8 = 1.1e-3 typical-bound; measured 1.6e-5 on another
#: machine (AVX-512) where 1e-5 failed. 1e-4 is 6x that measurement.
F32_NET = 1e-4


def f32(terms: int, layers: int = 1, scale: float = 1.0, safety: float = 10.0) -> float:
    """Absolute tolerance for two float32 evaluations of one function that accumulate in different orders.

    Args:
        terms: the length of the longest reduction in one layer (a matmul's inner dimension).
        layers: how many such reductions are chained.
        scale: the magnitude of the values summed (the largest absolute output, for instance).
        safety: the factor over the typical bound ``layers x sqrt(terms) x eps32 x scale``.
    """
    if terms < 1 or layers < 1 or scale < 0 or safety <= 0:
        raise ValueError(f"f32: terms and layers must be >= 1, scale >= 0 and safety > 0, got {terms}, {layers}, "
                         f"{scale}, {safety}")
    return safety * layers * math.sqrt(terms) * EPS32 * scale
