"""GLVQ's quantizer and its layer: grouped lattice vector quantization of a Linear weight with Babai rounding.

The algorithm, its formulas and the choices the paper leaves open (marked "inferred") are described with the method,
in :mod:`lowrank_lit.methods.glvq` (the paper's component, the post-training :class:`~lowrank_lit.methods.glvq.GLVQ`
callback). Here are the pieces the callback and the compress-adapt-merge study
(:mod:`lowrank_lit.studies.compress_adapt_merge`) share: the per-group quantizer (:func:`quantize_group`), the layer
quantizer (:func:`quantize_linear`) with its baselines (per-group RTN, the best scalar lattice), salience-determined
bit allocation, bit packing, and :class:`GLVQLinear`, the layer that serves the packed codes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.argtypes import LearningRate

__all__ = [
    "INITS",
    "CODEBOOKS",
    "METHODS",
    "mulaw",
    "mulaw_inv",
    "babai_round",
    "rtn_quantize",
    "GroupResult",
    "decode_groups",
    "quantize_group",
    "select_groups",
    "salience_bit_allocation",
    "storage_bits",
    "pack_codes",
    "pack_groups",
    "unpack_codes",
    "GLVQLinear",
    "quantize_linear",
    "QUANTIZED_FORMAT",
    "save_quantized",
    "layer_inputs",
    "check_bits",
    "check_codebook",
]

#: the starting generation matrices of ``glvq`` (:func:`quantize_linear`'s ``init``)
INITS = ("both", "cholesky", "scalar")
#: the codebooks: name -> the half-step offset ``o`` of the decoded points ``G (z + o)``
CODEBOOKS = {"integer": 0.0, "symmetric": 0.5}
#: the quantizers: GLVQ, the best scalar lattice (``G = s I``), per-group RTN
METHODS = ("glvq", "scalar", "rtn")


def mulaw(x: torch.Tensor, mu: torch.Tensor | float) -> torch.Tensor:
    """``F_mu(x) = sign(x) ln(1 + mu |x|) / ln(1 + mu)`` (maps [-1, 1] onto [-1, 1])."""
    mu = torch.as_tensor(mu, dtype=x.dtype)
    return torch.sign(x) * torch.log1p(mu * x.abs()) / torch.log1p(mu)


def mulaw_inv(v: torch.Tensor, mu: torch.Tensor | float) -> torch.Tensor:
    """``F_mu^-1(v) = sign(v) ((1 + mu)^|v| - 1) / mu``."""
    mu = torch.as_tensor(mu, dtype=v.dtype)
    return torch.sign(v) * torch.expm1(v.abs() * torch.log1p(mu)) / mu


def check_codebook(codebook: str) -> None:
    """Refuse a codebook that is not one of :data:`CODEBOOKS` (one line naming the argument and the allowed values)."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"GLVQ: codebook={codebook!r}; allowed: {', '.join(CODEBOOKS)}")


def check_bits(bits: int) -> None:
    """Refuse a code width that is not an integer in [1, 8] (one line naming the argument and the allowed values)."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"GLVQ: bits={bits!r}; allowed: an integer in [1, 8]")


def babai_round(G: torch.Tensor, Y: torch.Tensor, bits: int | None = None, offset: float = 0.0) -> torch.Tensor:
    """Babai rounding ``z = round(G^-1 Y - offset)``, clamped to ``[-2^(b-1), 2^(b-1) - 1]`` when ``bits`` is given
    (the nearest point of the coset ``G (Z^d + offset)`` coordinate by coordinate in ``G``'s basis).

    Args:
        G: ``(d, d)`` generation matrix.
        Y: ``(d, L)`` points.
        bits: code width; None: no clamp.
        offset: the codebook's half-step offset ``o`` (0: the lattice itself). Default: 0.
    """
    Z = torch.linalg.solve(G, Y)
    Z = torch.round(Z - offset if offset else Z)
    if bits is not None:
        check_bits(bits)
        Z = Z.clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return Z


def rtn_quantize(W: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Round-to-nearest per (row, column group): min-max uniform with ``2^bits`` levels. Returns W_hat."""
    check_bits(bits)
    m, n = W.shape
    if n % group_size:
        raise ValueError(f"rtn_quantize: group_size={group_size} does not divide in_features={n}")
    Wg = W.reshape(m, n // group_size, group_size)
    lo, hi = Wg.amin(dim=2, keepdim=True), Wg.amax(dim=2, keepdim=True)
    step = (hi - lo).clamp_min(1e-12) / (2**bits - 1)
    return (torch.round((Wg - lo) / step).clamp(0, 2**bits - 1) * step + lo).reshape(m, n)


def _to_vectors(Wg: torch.Tensor, d: int) -> torch.Tensor:
    return Wg.reshape(-1, d).T  # (m, n_g) -> (d, L): d consecutive entries of a row per vector


def _from_vectors(Y: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return Y.T.reshape(shape)


def _loss(E: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    return torch.trace(E @ H @ E.T)  # ||E X||_F^2 with H = X X^T


@dataclass
class GroupResult:
    """The quantized form of one column group."""

    codes: torch.Tensor  # (d, L) integers
    G: torch.Tensor  # (d, d)
    mu: float  # 0 = no companding
    scale: float
    bits: int
    loss: float  # calibration output error ||(W_g - W_hat_g) X_g||^2
    init_loss: float = float("nan")
    history: list[float] = field(default_factory=list)
    start: GroupResult | None = None  # glvq: the best scalar lattice it started from
    runs: list[GroupResult] = field(default_factory=list)  # glvq: the best iterate of each start
    offset: float = 0.0  # the codebook's half-step offset: decoded points G (z + offset)

    def decode(self, shape: tuple[int, int]) -> torch.Tensor:
        return _decode(self.G, self.codes, self.mu, self.scale, shape, self.offset)


def _decode(G: torch.Tensor, Z: torch.Tensor, mu: Any, scale: float, shape: tuple[int, int],
            offset: float = 0.0) -> torch.Tensor:
    V = G @ (Z + offset if offset else Z)  # (d, L)
    if isinstance(mu, torch.Tensor) or mu:
        V = mulaw_inv(V, mu)
    return scale * _from_vectors(V, shape)


def decode_groups(G: torch.Tensor, codes: torch.Tensor, mu: torch.Tensor, scale: torch.Tensor, out_features: int,
                  group_size: int, offset: float = 0.0) -> torch.Tensor:
    """Decode every column group at once: ``W_hat[:, g] = s_g F_mu_g^-1(G_g (z + o))`` in ``G``'s dtype (float32 in a
    layer).

    One batched matmul over all groups' d-vectors and a vectorised mu-law inverse (groups with ``mu = 0``
    are not companded); agrees with the float64 per-group reference :func:`_decode` to ``G``'s rounding.

    Args:
        G: ``(n_groups, d, d)`` generation matrices.
        codes: ``(n_groups, d, L)`` integer codes, ``L = out_features * group_size / d``.
        mu: ``(n_groups,)`` companding parameters (0: none).
        scale: ``(n_groups,)`` scales.
        out_features: rows of the weight.
        group_size: columns per group.
        offset: the codebook's half-step offset ``o``. Default: 0.

    Returns:
        ``(out_features, n_groups * group_size)`` weight.
    """
    n_groups = G.shape[0]
    Z = codes.to(G.dtype)
    mu = mu.to(G.dtype).view(n_groups, 1, 1)
    companded = mu > 0
    s = scale.to(G.dtype).view(n_groups, 1, 1)
    if not bool(companded.any()):  # s G (z + o) = (s G) z + o (s G) 1: scale and offset folded into the d x d matrices
        G = G * s
    # G (z + o) = G z + o G 1 (the offset as the bias of one batched matmul, not a pass over the codes)
    V = torch.baddbmm(offset * G.sum(-1, keepdim=True), G, Z) if offset else torch.bmm(G, Z)  # (n_groups, d, L)
    if bool(companded.any()):
        V = torch.where(companded, mulaw_inv(V, torch.where(companded, mu, torch.ones_like(mu))), V)
        V = V * s
    # vector l = r * (group_size / d) + j holds row r, columns j*d .. j*d + d - 1 of its group, so
    # W[r, g*group_size + j*d + k] = V[g, k, l]: one strided copy puts every group in place
    d = G.shape[1]
    V = V.view(n_groups, d, out_features, group_size // d)
    return V.permute(2, 0, 3, 1).reshape(out_features, n_groups * group_size)


def _encode(G: torch.Tensor, Wg: torch.Tensor, mu: Any, scale: float, d: int, bits: int,
            offset: float = 0.0) -> torch.Tensor:
    Y = _to_vectors(Wg / scale, d)
    if isinstance(mu, torch.Tensor) or mu:
        Y = mulaw(Y, mu)
    return babai_round(G, Y, bits, offset)


def _kurtosis(w: torch.Tensor) -> float:
    w = w.reshape(-1).double()
    c = w - w.mean()
    return float((c**4).mean() / (c**2).mean().clamp_min(1e-30) ** 2)


def quantize_group(
    Wg: torch.Tensor,
    H: torch.Tensor,
    bits: int,
    dim: int = 8,
    method: str = "glvq",
    compand: bool = False,
    steps: int = 200,
    lr: LearningRate = 1e-2,
    lam: float = 0.0,
    sigma_range: tuple[float, float] = (1e-4, 1e4),
    scale_grid: int = 64,
    init: str = "both",
    codebook: str = "integer",
) -> GroupResult:
    """Quantize one column group ``Wg (m, n_g)`` against its calibration Gram matrix ``H (n_g, n_g)``.

    ``method``: ``scalar`` (best ``G = s I``, s grid-searched on the loss) or ``glvq`` (alternating Babai /
    Adam on ``G`` (and ``mu`` with ``compand``), singular values clamped to ``sigma_range``, best iterate
    kept, never above the scalar lattice). ``init`` picks the starting ``G_0``: ``cholesky`` (the card's
    ``G_0``: lower Cholesky factor of the covariance of the d-vectors, times ``c / 2^(b-1)`` with ``c``
    grid-searched on the loss), ``scalar`` (the best scalar lattice) or ``both`` (one run from each, the
    better kept). ``lam`` weighs ``||G - G_0||_F^2``. Adam's step is ``lr`` times the mean ``|diag G_0|``
    (inferred: the paper gives no optimiser settings). ``codebook``: ``integer`` or ``symmetric`` (module
    docstring).
    """
    check_bits(bits)
    check_codebook(codebook)
    if method not in ("glvq", "scalar"):
        raise ValueError(f"quantize_group: method={method!r}; allowed: glvq, scalar")
    if init not in INITS:
        raise ValueError(f"quantize_group: init={init!r}; allowed: {', '.join(INITS)}")
    # callable from evaluation hooks (Lightning's test loop runs in inference mode): optimise with autograd on
    with torch.inference_mode(False), torch.enable_grad():
        return _quantize_group(Wg.clone(), H.clone(), bits, dim, method, compand, steps, lr, lam, sigma_range, scale_grid, init,
                               CODEBOOKS[codebook])


def _cholesky_init(Y: torch.Tensor, bits: int, loss: Any, grid: int) -> torch.Tensor | None:
    """``c * chol(cov(Y)) / 2^(b-1)`` with ``c`` in [0.25, 6] minimising ``loss(G)``; None if the covariance is degenerate."""
    d = Y.shape[0]
    C = torch.cov(Y)  # (d, d) covariance of the d-vectors
    level = float(C.diagonal().mean())
    if not level > 0:  # constant d-vectors (or non-finite): no Cholesky start
        return None
    C = C + 1e-8 * level * torch.eye(d, dtype=C.dtype)
    L, info = torch.linalg.cholesky_ex(C)
    if int(info) != 0 or not bool(torch.isfinite(L).all()):
        return None
    best_G, best = None, math.inf
    for c in torch.linspace(0.25, 6.0, grid).tolist():  # the range of c is inferred
        G = c * L / 2 ** (bits - 1)
        val = float(loss(G))
        if val < best:
            best_G, best = G, val
    return best_G


def _quantize_group(Wg: torch.Tensor, H: torch.Tensor, bits: int, dim: int, method: str, compand: bool, steps: int,
                    lr: float, lam: float, sigma_range: tuple[float, float], scale_grid: int,
                    init: str = "both", offset: float = 0.0) -> GroupResult:
    m, ng = Wg.shape
    if (m * ng) % dim:
        raise ValueError(f"GLVQ: dim={dim} does not divide the group's m * group_size = {m} * {ng}")
    if not bool(torch.isfinite(Wg).all()) or not bool(torch.isfinite(H).all()):
        raise ValueError("GLVQ: non-finite weights or calibration activations")
    Wg, H = Wg.double(), H.double()
    scale = float(Wg.abs().max().clamp_min(1e-12)) if compand else 1.0
    mu0 = min(max(10.0 * _kurtosis(Wg), 10.0), 255.0) if compand else 0.0
    eye = torch.eye(dim, dtype=torch.float64)

    def loss_of(G: torch.Tensor, mu: Any) -> tuple[torch.Tensor, torch.Tensor]:
        Z = _encode(G.detach(), Wg, mu.detach() if isinstance(mu, torch.Tensor) else mu, scale, dim, bits, offset)
        return _loss(Wg - _decode(G, Z, mu, scale, (m, ng), offset), H), Z

    # best scalar lattice: G = s I on a grid of step sizes
    ref = float(Wg.abs().max() / scale)
    ref = mulaw(torch.tensor(ref), mu0).item() if compand else ref
    best_s, best = None, math.inf
    for s in torch.linspace(ref / 2 ** (bits + 2), 2 * ref / max(2 ** (bits - 1) - 0.5, 0.5), scale_grid).tolist():
        val = float(loss_of(s * eye, mu0)[0])
        if val < best:
            best_s, best = s, val
    G0 = best_s * eye
    loss0, Z0 = loss_of(G0, mu0)
    if method == "scalar":
        return GroupResult(Z0, G0, mu0, scale, bits, float(loss0), float(loss0), offset=offset)
    starts = [G0] if init in ("scalar", "both") else []
    if init in ("cholesky", "both"):
        Y = _to_vectors(Wg / scale, dim)
        Gc = _cholesky_init(mulaw(Y, mu0) if compand else Y, bits, lambda G: loss_of(G, mu0)[0], scale_grid)
        if Gc is not None:
            starts.append(Gc)
    scalar_state = (G0.clone(), mu0, Z0, float(loss0))
    best_state = scalar_state  # never above the best scalar lattice
    run_bests = []  # each start's best iterate (for the per-layer choice of select_groups)
    history = [float(loss0)]
    for G_start in starts:
        run_best = scalar_state
        G = G_start.clone().requires_grad_(True)
        log_mu = torch.tensor(math.log(mu0), dtype=torch.float64, requires_grad=True) if compand else None
        step = lr * max(float(G_start.diagonal().abs().mean()), 1e-8) if lr else 1e-3
        opt = torch.optim.Adam([G] + ([log_mu] if log_mu is not None else []), lr=step)
        for _ in range(steps):
            mu = log_mu.exp() if log_mu is not None else 0.0
            loss, Z = loss_of(G, mu)
            total = loss + lam * ((G - G_start) ** 2).sum() if lam else loss
            opt.zero_grad()
            total.backward()
            opt.step()
            with torch.no_grad():
                U, S, Vh = torch.linalg.svd(G)
                G.copy_(U @ torch.diag(S.clamp(*sigma_range)) @ Vh)  # spectral clamp
                if log_mu is not None:
                    log_mu.clamp_(math.log(10.0), math.log(255.0))
            mu_now = float(log_mu.detach().exp()) if log_mu is not None else 0.0
            val, Zn = loss_of(G.detach(), mu_now)
            history.append(float(val))
            if float(val) < run_best[3]:
                run_best = (G.detach().clone(), mu_now, Zn, float(val))
        run_bests.append(run_best)
        if run_best[3] < best_state[3]:
            best_state = run_best
    Gb, mub, Zb, lb = best_state
    if torch.linalg.cond(Gb) > 1e8:
        raise ValueError(f"GLVQ: the generation matrix became ill-conditioned (cond {float(torch.linalg.cond(Gb)):.3g} > 1e8)")
    start = GroupResult(Z0, G0, mu0, scale, bits, float(loss0), float(loss0), offset=offset)
    runs = [GroupResult(Zr, Gr, mur, scale, bits, lr_, float(loss0), offset=offset) for Gr, mur, Zr, lr_ in run_bests
            if torch.linalg.cond(Gr) <= 1e8]
    return GroupResult(Zb, Gb, mub, scale, bits, lb, float(loss0), history, start, runs, offset)


def select_groups(W: torch.Tensor, H: torch.Tensor, options: list[list[torch.Tensor]], max_passes: int = 20) -> list[int]:
    """Choose one decoded block per column group so that the layer's output error is smallest.

    ``options[g]`` are candidate decodings ``(m, n_g)`` of group g, the groups being consecutive column
    blocks of ``W (m, n)`` (for GLVQ: the best learned lattice, the best iterate of each start, and last
    the scalar lattice). Per-group keep-best ignores the cross terms ``tr(E_g H_{gg'} E_{g'}^T)`` of
    ``||(W - W_hat) X||^2``, so learned groups can add up to more layer error than the scalar lattices
    (inferred fix, not in the paper): start from the best uniform choice (the j-th candidate of every
    group, j = 0 .. the last) and switch single groups while that lowers the layer error. Never above any
    uniform choice, in particular all-scalar.

    A switch of group g from ``W_hat_g`` to ``W_hat_g'`` changes the error by
    ``2 <D, (E H)_g> + tr(D H_gg D^T)`` with ``D = W_hat_g - W_hat_g'``; ``P = E H (m, n)`` is updated in
    place on every accepted switch, so a pass costs ``O(m n_g^2)`` per candidate instead of a full
    ``O(m n^2)`` evaluation (a 4096 x 4096 layer stays cheap).
    """
    def scored(choice: list[int]) -> tuple[float, list[int], torch.Tensor]:
        E = W - torch.cat([options[g][c] for g, c in enumerate(choice)], dim=1)  # (m, n) residual
        P = E @ H  # (m, n)
        return float((E * P).sum()), choice, P  # tr(E H E^T)

    width = max(len(o) for o in options)
    best, choice, P = min((scored([min(j, len(o) - 1) for o in options]) for j in range(width)), key=lambda t: t[0])
    offsets = [0]
    for o in options:
        offsets.append(offsets[-1] + o[0].shape[1])
    tol = 1e-10 * max(best, 1e-300)  # accept only clear decreases: no cycling on rounding noise
    for _ in range(max_passes):
        improved = False
        for g, opts in enumerate(options):
            sl = slice(offsets[g], offsets[g + 1])
            Hgg = H[sl, sl]  # (n_g, n_g)
            for c in range(len(opts)):
                if c == choice[g]:
                    continue
                D = opts[choice[g]] - opts[c]  # (m, n_g): the change of E_g
                delta = float(2 * (D * P[:, sl]).sum() + ((D @ Hgg) * D).sum())
                if delta < -tol:
                    P += D @ H[sl, :]
                    choice[g], best, improved = c, best + delta, True
        if not improved:
            break
    return choice


def salience_bit_allocation(saliences: torch.Tensor, avg_bits: int, error_of: Any = None) -> torch.Tensor:
    """Bits per group in {N-1, N, N+1} with as many N+1 as N-1 groups (mean exactly N).

    The ``k`` most salient groups get N+1, the ``k`` least salient N-1; ``k`` in ``[0, groups // 2]``
    minimises ``error_of(bits)`` (uniform when ``error_of`` is None or all saliences are equal).
    """
    if avg_bits < 2:
        raise ValueError(f"salience_bit_allocation: avg_bits={avg_bits!r}; allowed: >= 2 (groups get N-1 >= 1 bits)")
    n = len(saliences)
    order = torch.argsort(saliences, descending=True, stable=True)
    uniform = torch.full((n,), avg_bits, dtype=torch.long)
    if error_of is None or bool((saliences == saliences[0]).all()):
        return uniform
    best, best_err = uniform, float(error_of(uniform))
    for k in range(1, n // 2 + 1):
        bits = uniform.clone()
        bits[order[:k]] = avg_bits + 1
        bits[order[n - k :]] = avg_bits - 1
        err = float(error_of(bits))
        if err < best_err:
            best, best_err = bits, err
    return best


def storage_bits(out_features: int, group_size: int, bits: torch.Tensor, dim: int) -> int:
    """``sum_g out * group_size * b_g + groups * (d^2 + 1) * 16`` bits (codes + fp16 G and mu per group)."""
    return int(out_features * group_size * int(bits.sum()) + len(bits) * (dim * dim + 1) * 16)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed ``bits``-bit codes -> bytes: ``b`` bits per code, 8 codes in ``b`` bytes (2-bit codes: 4 per byte).

    A code ``z`` in ``[-2^(b-1), 2^(b-1) - 1]`` is stored as ``u = z + 2^(b-1)``; code ``i`` of a run of 8 takes
    bits ``b i .. b i + b - 1`` of a little-endian ``8 b``-bit word (the last run is padded with zeros).

    Returns:
        ``(ceil(n / 8) * b,)`` uint8 for ``n = codes.numel()`` codes (flattened row-major).
    """
    check_bits(bits)
    u = codes.reshape(-1).to(torch.int64) + (1 << (bits - 1))  # (n,) in [0, 2^b)
    u = F.pad(u, (0, (-u.numel()) % 8)).view(-1, 8)  # (words, 8)
    word = (u << (torch.arange(8, device=u.device) * bits)).sum(1)  # (words,) 8 b <= 64 bits
    return ((word.unsqueeze(1) >> (torch.arange(bits, device=u.device) * 8)) & 0xFF).to(torch.uint8).reshape(-1)


def pack_groups(codes: Sequence[torch.Tensor], bits: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The codes of every column group packed at its own bit width (:func:`pack_codes`), groups in order: the
    ``packed`` buffer of :class:`GLVQLinear`."""
    return torch.cat([pack_codes(c, int(b)) for c, b in zip(codes, bits, strict=True)])


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`pack_codes` output, as int8 ``(count,)``."""
    check_bits(bits)
    if 8 % bits == 0:  # 1, 2, 4, 8 bits: whole codes per byte, unpacked in uint8 (8x less memory traffic)
        per = 8 // bits
        shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
        u = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # (bytes, 8 / b): code k of byte j at bits b k
        return (u.reshape(-1)[:count].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
    wide = torch.int32 if bits <= 3 else torch.int64  # an 8 b-bit word fits (int32: half the memory traffic)
    by = packed.reshape(-1, bits).to(wide)  # (words, b)
    word = (by << (torch.arange(bits, device=by.device, dtype=wide) * 8)).sum(1, dtype=wide)  # (words,)
    u = (word.unsqueeze(1) >> (torch.arange(8, device=by.device, dtype=wide) * bits)) & ((1 << bits) - 1)  # (words, 8)
    return (u.reshape(-1)[:count] - (1 << (bits - 1))).to(torch.int8)


class GLVQLinear(nn.Module):
    """A Linear layer stored as bit-packed lattice codes: ``W_hat = s F_mu^-1(G z)`` per column group.

    Buffers: ``packed`` (uint8: each group's ``d x L`` codes at its ``b_g`` bits, :func:`pack_codes`, groups one
    after another), ``G (groups, d, d)``, ``mu (groups,)`` (0 = no companding), ``scale (groups,)``,
    ``bits (groups,)``, ``offset`` (a scalar: the codebook's half-step offset, decoded points ``G (z + offset)``;
    0 when a state written before it existed is loaded); ``bias`` as in the original layer. ``state_dict`` holds only these, so a saved quantized
    model reloads into ``GLVQLinear(in, out, ...)`` exactly (a state with unpacked int8 ``codes``, as written by
    earlier versions, is packed on loading).

    Two ways to serve it:

    * cached (default): the dense weight is decoded once (:func:`decode_groups`) and kept until the buffers are
      reloaded: the forward pass costs an ``nn.Linear``'s, the memory a dense float weight's;
    * ``compact=True``: no dense weight is kept; every forward pass unpacks and decodes ``tile_groups`` column
      groups at a time and accumulates ``x[:, cols] W_tile^T``: resident memory is the packed codes plus ``G``,
      ``mu``, ``scale`` (about ``(b + overhead) / 32`` of fp32), the output equals the cached mode's to float
      rounding.

    Args:
        in_features: input width.
        out_features: output width.
        group_size: columns per group.
        dim: lattice dimension d.
        bias: keep a bias. Default: True.
        compact: decode on the fly instead of caching the dense weight. Default: False.
        tile_groups: column groups decoded at once in compact mode. Default: 4.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, dim: int, bias: bool = True,
                 compact: bool = False, tile_groups: int = 4) -> None:
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"GLVQLinear: group_size={group_size} does not divide in_features={in_features}")
        if (out_features * group_size) % dim:
            raise ValueError(f"GLVQLinear: dim={dim} does not divide out_features * group_size = {out_features * group_size}")
        if tile_groups < 1:
            raise ValueError(f"GLVQLinear: tile_groups={tile_groups}; allowed: an integer >= 1")
        n_groups = in_features // group_size
        self.in_features, self.out_features, self.group_size, self.dim = in_features, out_features, group_size, dim
        self.compact, self.tile_groups = compact, tile_groups
        self.register_buffer("packed", torch.zeros(0, dtype=torch.uint8))
        self.register_buffer("G", torch.zeros(n_groups, dim, dim))
        self.register_buffer("mu", torch.zeros(n_groups))
        self.register_buffer("scale", torch.ones(n_groups))
        self.register_buffer("bits", torch.zeros(n_groups, dtype=torch.long))
        self.register_buffer("offset", torch.zeros(()))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._cache: torch.Tensor | None = None

    @property
    def codes_per_group(self) -> int:
        return self.out_features * self.group_size  # d * L

    def _offsets(self) -> list[int]:
        """Byte offset of every group's codes in ``packed`` (and the end)."""
        words = -(-self.codes_per_group // 8)
        out = [0]
        for b in self.bits.tolist():
            out.append(out[-1] + words * int(b))
        return out

    def group_codes(self, start: int, stop: int) -> torch.Tensor:
        """Unpacked codes of groups ``start .. stop - 1``: ``(stop - start, d, L)`` int8."""
        off, n, d = self._offsets(), self.codes_per_group, self.dim
        widths = self.bits[start:stop]
        b = int(widths[0])
        if b and bool((widths == b).all()) and n % 8 == 0:  # one width: the groups' bytes are one run, one unpack
            return unpack_codes(self.packed[off[start]:off[stop]], b, (stop - start) * n).view(stop - start, d, n // d)
        return torch.stack([unpack_codes(self.packed[off[g]:off[g + 1]], int(self.bits[g]), n).view(d, n // d)
                            if int(self.bits[g]) else torch.zeros(d, n // d, dtype=torch.int8)  # not quantized yet
                            for g in range(start, stop)])

    def set_codes(self, codes: torch.Tensor, bits: torch.Tensor | int) -> None:
        """Store ``codes (groups, d, L)`` (signed, within each group's ``bits``), bit-packed."""
        bits = torch.as_tensor(bits, dtype=torch.long).expand(self.G.shape[0]).clone()
        expected = (self.G.shape[0], self.dim, self.codes_per_group // self.dim)
        if tuple(codes.shape) != expected:
            raise ValueError(f"GLVQLinear.set_codes: codes of shape {tuple(codes.shape)}; expected {expected}")
        with torch.no_grad():
            self.bits.copy_(bits)
            self.packed = pack_groups(list(codes), bits).to(self.G.device)
        self._cache = None

    def _drop_cache(self) -> None:
        self._cache = None

    @property
    def codes(self) -> torch.Tensor:
        """Every group's codes, unpacked: ``(groups, d, L)`` int8."""
        return self.group_codes(0, self.G.shape[0])

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        old = state_dict.pop(prefix + "codes", None)
        if old is not None:  # unpacked int8 codes of an earlier version
            bits = state_dict[prefix + "bits"]
            state_dict[prefix + "packed"] = pack_groups(list(old), bits)
        if prefix + "packed" in state_dict:  # its length depends on the bits: take the stored size
            self.packed = torch.empty_like(state_dict[prefix + "packed"], device=self.packed.device)
            state_dict.setdefault(prefix + "offset", torch.zeros(()))  # written before the codebook offset existed
        self._cache = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_groups(self, results: list[GroupResult]) -> None:
        with torch.no_grad():
            for g, r in enumerate(results):
                self.G[g] = r.G.float()
                self.mu[g] = float(r.mu)
                self.scale[g] = float(r.scale)
                self.bits[g] = r.bits
            offsets = {float(r.offset) for r in results}
            if len(offsets) > 1:
                raise ValueError(f"GLVQLinear.set_groups: groups with different codebook offsets {sorted(offsets)}")
            self.offset.fill_(offsets.pop() if offsets else 0.0)
            self.packed = pack_groups([r.codes.to(torch.int8) for r in results], [r.bits for r in results]).to(self.G.device)
        self._cache = None

    def _decode(self, start: int, stop: int) -> torch.Tensor:
        """Columns of groups ``start .. stop - 1`` of the decoded weight: ``(out, (stop - start) group_size)``."""
        return decode_groups(self.G[start:stop], self.group_codes(start, stop).to(self.G.device), self.mu[start:stop],
                             self.scale[start:stop], self.out_features, self.group_size, float(self.offset))

    def weight_hat(self) -> torch.Tensor:
        """The decoded ``(out, in)`` weight in the buffers' dtype (batched :func:`decode_groups`); cached until the
        buffers are reloaded, except in compact mode."""
        if self._cache is not None:
            return self._cache
        W = self._decode(0, self.G.shape[0])
        if not self.compact:
            self._cache = W
        return W

    def weight_hat_reference(self) -> torch.Tensor:
        """The same weight decoded group by group in float64 (the reference :meth:`weight_hat` is tested against)."""
        codes = self.codes
        cols = [_decode(self.G[g].double(), codes[g].double(), float(self.mu[g]), float(self.scale[g]),
                        (self.out_features, self.group_size), float(self.offset)) for g in range(codes.shape[0])]
        return torch.cat(cols, dim=1)

    def set_compact(self, compact: bool = True) -> GLVQLinear:
        """Switch between compact and cached serving (dropping the dense cache when compact)."""
        self.compact = compact
        self._cache = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.compact:
            return F.linear(x, self.weight_hat().to(x.dtype), self.bias)
        flat = x.reshape(-1, self.in_features)  # (N, in)
        out = flat.new_zeros(flat.shape[0], self.out_features) if self.bias is None else \
            self.bias.to(x.dtype).expand(flat.shape[0], -1).clone()  # (N, out)
        gs, n_groups = self.group_size, self.G.shape[0]
        for start in range(0, n_groups, self.tile_groups):
            stop = min(start + self.tile_groups, n_groups)
            W = self._decode(start, stop).to(x.dtype)  # (out, tile columns)
            out.addmm_(flat[:, start * gs:stop * gs], W.T)
        return out.view(*x.shape[:-1], self.out_features)

    def storage_bits(self) -> int:
        return storage_bits(self.out_features, self.group_size, self.bits, self.dim)


def quantize_linear(
    linear: nn.Linear,
    X: torch.Tensor,
    bits: int,
    group_size: int = 32,
    dim: int = 8,
    method: str = "glvq",
    compand: bool = False,
    sdba: bool = False,
    steps: int = 200,
    init: str = "both",
    codebook: str = "integer",
) -> tuple[nn.Module, dict[str, float]]:
    """Quantize ``linear`` with calibration inputs ``X (N, in_features)``.

    Returns ``(layer, report)``: a :class:`GLVQLinear` (``glvq``/``scalar``) or an ``nn.Linear`` holding the
    RTN weights (``rtn``), and ``{"rel_error", "bits_per_weight", "avg_code_bits", "scalar_groups"}`` where
    ``rel_error`` = ``||(W - W_hat) X^T||^2 / ||W X^T||^2``. ``init``, ``codebook``: see :func:`quantize_group`
    (RTN has its own min-max grid: ``codebook`` does not apply to it).
    """
    if isinstance(linear, GLVQLinear):
        raise ValueError("GLVQ: this layer is already quantized")
    if method not in METHODS:
        raise ValueError(f"GLVQ: method={method!r}; allowed: {', '.join(METHODS)}")
    check_bits(bits)
    check_codebook(codebook)
    W = linear.weight.detach().double()
    m, n = W.shape
    if X.ndim != 2 or X.shape[1] != n:
        raise ValueError(f"GLVQ: calibration X must be (N, in_features={n}), got {tuple(X.shape)}")
    if n % group_size:
        raise ValueError(f"GLVQ: group_size={group_size} does not divide in_features={n} (pad the layer or pick another size)")
    if not bool(torch.isfinite(W).all()) or not bool(torch.isfinite(X).all()):
        raise ValueError("GLVQ: non-finite weights or calibration activations")
    Xd = X.double()
    H = Xd.T @ Xd  # (n, n)
    ref = float(_loss(W, H))
    if method == "rtn":
        What = rtn_quantize(W, bits, group_size)
        layer = nn.Linear(n, m, bias=linear.bias is not None)
        with torch.no_grad():
            layer.weight.copy_(What.float())
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer, {"rel_error": float(_loss(W - What, H)) / ref, "bits_per_weight": float(bits) + 32 / group_size,
                       "avg_code_bits": float(bits)}
    groups = n // group_size
    sl = [slice(g * group_size, (g + 1) * group_size) for g in range(groups)]

    def run(bits_per_group: list[int]) -> list[GroupResult]:
        return [quantize_group(W[:, s], H[s, s], b, dim, method, compand, steps, init=init, codebook=codebook)
                for s, b in zip(sl, bits_per_group, strict=True)]

    if sdba:
        cache: dict[tuple[int, int], GroupResult] = {}

        def result(g: int, b: int) -> GroupResult:
            if (g, b) not in cache:
                cache[(g, b)] = quantize_group(W[:, sl[g]], H[sl[g], sl[g]], b, dim, method, compand, steps, init=init,
                                               codebook=codebook)
            return cache[(g, b)]

        def error_of(alloc: torch.Tensor) -> float:
            What = torch.cat([result(g, int(b)).decode((m, group_size)) for g, b in enumerate(alloc)], dim=1)
            return float(_loss(W - What, H))

        sal = torch.stack([(W[:, s] ** 2 * Xd[:, s].pow(2).sum(0)).sum() for s in sl])
        alloc = salience_bit_allocation(sal, bits, error_of)
        results = [result(g, int(b)) for g, b in enumerate(alloc)]
    else:
        results = run([bits] * groups)
    fallback = 0
    if method == "glvq":
        # the decodings GLVQLinear will serve (G stored in float32), learned lattice then its scalar start
        candidates = [[r, *r.runs] + ([r.start] if r.start is not None else []) for r in results]
        choice = select_groups(W, H, [[_stored_decode(c, (m, group_size)) for c in cands] for cands in candidates])
        fallback = sum(r.start is not None and c == len(cands) - 1 for r, c, cands in zip(results, choice, candidates, strict=True))
        results = [cands[c] for c, cands in zip(choice, candidates, strict=True)]
    layer = GLVQLinear(n, m, group_size, dim, bias=linear.bias is not None)
    layer.set_groups(results)
    if linear.bias is not None:
        with torch.no_grad():
            layer.bias.copy_(linear.bias)
    What = layer.weight_hat().double()
    return layer, {"rel_error": float(_loss(W - What, H)) / ref, "bits_per_weight": layer.storage_bits() / (m * n),
                   "avg_code_bits": float(layer.bits.float().mean()), "scalar_groups": float(fallback)}


#: the ``format`` entry of a quantized model's safetensors metadata
QUANTIZED_FORMAT = "lowrank_lit.glvq/2"  # /2 adds L.offset (a /1 file means offset 0)


def save_quantized(module: nn.Module, path: str) -> dict[str, Any]:
    """Write a quantized model as one safetensors file a user can read without this package.

    Layout: every state-dict entry of ``module`` under its own name; a :class:`GLVQLinear` named ``L`` contributes
    ``L.packed`` (uint8, :func:`pack_codes` per column group, groups in order), ``L.G (groups, d, d)``,
    ``L.mu (groups,)`` (0: no companding), ``L.scale (groups,)``, ``L.bits (groups,)``, ``L.offset ()`` (the
    codebook's half-step offset) and ``L.bias``. The file's
    metadata holds ``format`` (:data:`QUANTIZED_FORMAT`) and ``layers``: JSON ``{L: {in_features, out_features,
    group_size, dim}}``. docs/methods/glvq.md has a reference decoder of this layout in numpy.

    Returns:
        the metadata written.
    """
    import json

    from safetensors.torch import save_file

    layers = {n: {"in_features": m.in_features, "out_features": m.out_features, "group_size": m.group_size,
                  "dim": m.dim} for n, m in module.named_modules() if isinstance(m, GLVQLinear)}
    if not layers:
        raise ValueError(f"save_quantized: {type(module).__name__} holds no GLVQLinear layer")
    meta = {"format": QUANTIZED_FORMAT, "layers": json.dumps(layers)}
    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    save_file(state, path, metadata=meta)
    return meta


def _stored_decode(r: GroupResult | None, shape: tuple[int, int]) -> torch.Tensor:
    """``r`` decoded exactly as :class:`GLVQLinear` serves it (float32 buffers, float32 weight)."""
    assert r is not None
    mu, scale = (float(torch.tensor(float(v), dtype=torch.float32)) for v in (r.mu, r.scale))
    return _decode(r.G.float().double(), r.codes.double(), mu, scale, shape, r.offset).float().double()


def layer_inputs(module: nn.Module, loader: Any, names: list[str], batches: int) -> dict[str, torch.Tensor]:
    """The inputs of the named layers of ``module`` on the first ``batches`` ``(x, ...)`` batches of ``loader``
    (forward hooks, no grad): name -> ``(N, in_features)``, the calibration data of :func:`quantize_linear`."""
    modules = dict(module.named_modules())
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = [modules[n].register_forward_hook(lambda mod, inp, out, n=n: inputs[n].append(
        inp[0].detach().reshape(-1, inp[0].shape[-1]))) for n in names]
    device = next(module.parameters()).device
    try:
        with torch.no_grad():
            for i, (x, *_rest) in enumerate(loader):
                if i >= batches:
                    break
                module(x.to(device))
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in inputs.items()}
