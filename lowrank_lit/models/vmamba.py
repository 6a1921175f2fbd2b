"""A small pure-torch VMamba: SS2D with four scan directions and re-assignable traversals.

SS2D (VMamba v2 form, no z-gate, ``ssm_ratio`` 1): ``x (B, C, H, W)`` -> 1x1 ``in_proj`` -> depthwise 3x3 conv ->
SiLU -> :func:`cross_scan` into four sequences of length ``L = H W`` (row-major, column-major, and both
reversed) -> one selective-scan parameter group per sequence -> :func:`cross_merge` (undo the flips and
transposes, sum) -> ``out_norm`` (LayerNorm) -> ``out_proj``.

Selective scan of group ``k``: ``[dt, B, C] = x_proj[k] u``, ``Delta = softplus(dt_proj[k] dt + b_dt[k])``,
``A = -exp(A_log[k])``; ``h_l = exp(Delta_l A) * h_{l-1} + Delta_l B_l u_l``, ``y_l = C_l . h_l + D_k u_l``.
:func:`selective_scan_ref` runs the recurrence step by step (the reference); :func:`selective_scan` computes the
same with ``mambapy``'s parallel (Blelloch) scan (``parallel=True``, the default) or with :func:`linear_scan`
(``parallel=False``): the recurrence in an ``autograd.Function`` whose backward is the adjoint recurrence (no
autograd graph per step), with a vmap rule, so ``torch.func.vmap`` can batch whole forward and backward passes
over it (TRUST's K traversals at once); mambapy's in-place scan has none.

Traversals: a permutation ``pi`` of the four directions (:meth:`SS2D.set_traversal`): group ``k`` scans
direction ``pi(k)`` (``xs <- xs[:, pi]``) and its output is put back with ``pi^-1`` (``argsort(pi)``) before the
merge -- correct for every permutation, not only involutions.

Init (VMamba / Mamba): ``A_log = log(1..N)``, ``D = 1``, the ``dt`` bias the inverse softplus of
``exp(U[log 1e-3, log 1e-1])``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.sharding import shard_unit

__all__ = ["selective_scan_ref", "selective_scan", "linear_scan", "vmappable_scans", "cross_scan", "cross_merge", "SS2D", "TinyVMamba", "LayerNorm2d",
           "PERMUTATIONS", "check_permutation", "set_traversal", "convert_official_vmamba"]

#: the 24 traversal permutations of the four scan directions, identity first
PERMUTATIONS: tuple[tuple[int, ...], ...] = tuple(itertools.permutations(range(4)))


def check_permutation(perm: object, where: str = "set_traversal") -> tuple[int, ...]:
    """``perm`` as a tuple if it is a permutation of 0..3, else ValueError naming the allowed values."""
    try:
        p = tuple(int(v) for v in perm)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        p = ()
    if sorted(p) != [0, 1, 2, 3]:
        raise ValueError(f"{where}: perm={perm!r} must be a permutation of 0, 1, 2, 3 (e.g. (0, 1, 3, 2))")
    return p


def selective_scan_ref(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor) -> torch.Tensor:
    """The recurrence step by step.

    Args:
        u, delta: ``(b, L, d)``; A: ``(d, N)``; B, C: ``(b, L, N)``; D: ``(d,)``.

    Returns:
        ``y (b, L, d)``.
    """
    b, L, d = u.shape
    h = u.new_zeros(b, d, A.shape[1])
    ys = []
    for t in range(L):
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1) + u * D


class _LinearScan(torch.autograd.Function):
    """:func:`linear_scan`: the recurrence forward, its adjoint recurrence backward, no autograd graph per step;
    ``generate_vmap_rule``: both are out-of-place torch ops, so vmap batches them as they are."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = x[:, 0]  # (b, ...)
        hs = [h]
        for t in range(1, x.shape[1]):
            h = torch.addcmul(x[:, t], a[:, t], h)  # h_t = a_t h_{t-1} + x_t
            hs.append(h)
        return torch.stack(hs, 1)  # (b, L, ...)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        a, h = ctx.saved_tensors  # (b, L, ...) each
        L = grad_h.shape[1]
        g = grad_h[:, L - 1]  # dLoss/dh_t in full: grad_h_t + a_{t+1} dLoss/dh_{t+1}, from the end
        gs = [g]
        for t in range(L - 2, -1, -1):
            g = torch.addcmul(grad_h[:, t], a[:, t + 1], g)
            gs.append(g)
        grad_x = torch.stack(gs[::-1], 1)  # (b, L, ...)
        grad_a = torch.cat([torch.zeros_like(h[:, :1]), grad_x[:, 1:] * h[:, :-1]], 1)  # dh_t/da_t = h_{t-1}
        return grad_a, grad_x


def linear_scan(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``h_t = a_t h_{t-1} + x_t`` over dim 1 with ``h_{-1} = 0``, for ``a, x (b, L, ...)`` of one shape.

    One pass over ``L`` forward and one backward (a custom backward: no autograd node per step), so linear work
    on ``(b, ...)`` slices; works under ``torch.func.vmap`` and ``grad``. Equal to ``mambapy.pscan.pscan`` to
    float32 rounding, forward and backward (``tests/test_vmamba.py``); ``lowrank bench trust`` times the two.
    """
    if a.shape != x.shape or a.dim() < 2:
        raise ValueError(f"linear_scan: a {tuple(a.shape)} and x {tuple(x.shape)}; allowed: one shape (b, L, ...)")
    return _LinearScan.apply(a, x)


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, parallel: bool = True) -> torch.Tensor:
    """:func:`selective_scan_ref`'s result; ``parallel`` uses ``mambapy.pscan.pscan`` (pure torch, any length),
    otherwise :func:`linear_scan` (vmap-able)."""
    dA = torch.exp(delta[..., None] * A)  # (b, L, d, N)
    dBu = (delta * u)[..., None] * B[:, :, None, :]  # (b, L, d, N): one broadcast product
    if parallel:
        from mambapy.pscan import pscan

        h = pscan(dA, dBu)  # (b, L, d, N)
    else:
        h = linear_scan(dA, dBu)
    return (h * C[:, :, None, :]).sum(-1) + u * D


@contextlib.contextmanager
def vmappable_scans(model: nn.Module) -> Iterator[None]:
    """Inside the block every SS2D of ``model`` scans with :func:`linear_scan` (for ``torch.func.vmap``)."""
    mods = [m for m in model.modules() if isinstance(m, SS2D)]
    before = [m.parallel for m in mods]
    for m in mods:
        m.parallel = False
    try:
        yield
    finally:
        for m, p in zip(mods, before, strict=True):
            m.parallel = p


def cross_scan(x: torch.Tensor) -> torch.Tensor:
    """``(b, d, H, W)`` -> ``(b, 4, d, L)``: row-major, column-major, reversed row-major, reversed column-major."""
    rows = x.flatten(2)  # (b, d, L)
    cols = x.transpose(2, 3).flatten(2)
    return torch.stack([rows, cols, rows.flip(-1), cols.flip(-1)], 1)


def cross_merge(ys: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """``(b, 4, d, L)`` per-direction outputs -> ``(b, d, H, W)``: undo flips and the transpose, then sum."""
    b, _, d, _ = ys.shape
    rows = ys[:, 0] + ys[:, 2].flip(-1)
    cols = ys[:, 1] + ys[:, 3].flip(-1)
    return rows.view(b, d, H, W) + cols.view(b, d, W, H).transpose(2, 3)


class SS2D(nn.Module):
    """2-D selective scan over four directions, one parameter group per direction (see the module docstring).

    Args:
        dim: channels C.
        d_state: N, the state size. Default: 4.
        dt_rank: rank of the ``dt`` projection; None: ``ceil(C / 16)``. Default: None.
        parallel: mambapy's parallel scan; False: :func:`linear_scan` (vmap-able). Default: True.
        bias: biases on ``in_proj``, the depthwise conv and ``out_proj`` (the official VMamba-T has none). Default: True.
    """

    def __init__(self, dim: int, d_state: int = 4, dt_rank: int | None = None, parallel: bool = True, bias: bool = True) -> None:
        super().__init__()
        if dim < 1 or d_state < 1:
            raise ValueError(f"SS2D: dim={dim}, d_state={d_state}; allowed: integers >= 1")
        r = dt_rank or math.ceil(dim / 16)
        self.dim, self.d_state, self.dt_rank, self.parallel = dim, d_state, r, parallel
        self.in_proj = nn.Conv2d(dim, dim, 1, bias=bias)
        self.conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=bias)
        self.x_proj = nn.Parameter(torch.randn(4, r + 2 * d_state, dim) / math.sqrt(dim))  # (K, R + 2N, d)
        self.dt_proj_weight = nn.Parameter(torch.randn(4, dim, r) * r**-0.5)  # (K, d, R)
        dt = torch.exp(torch.rand(4, dim) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_proj_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(4, dim, 1))
        self.D = nn.Parameter(torch.ones(4, dim))
        self.out_norm = nn.LayerNorm(dim)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.register_buffer("perm", torch.arange(4), persistent=False)

    def set_traversal(self, perm: object) -> None:
        """Group ``k`` scans direction ``perm[k]``."""
        self.perm = torch.tensor(check_permutation(perm), device=self.A_log.device)

    def adaptable_parameters(self) -> list[nn.Parameter]:
        """Every SS2D parameter except ``out_norm`` (TRUST's "ss2d" set)."""
        return [p for n, p in self.named_parameters() if not n.startswith("out_norm.")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, H, W = x.shape
        u = F.silu(self.conv2d(self.in_proj(x)))  # (b, d, H, W)
        xs = cross_scan(u)[:, self.perm]  # (b, K, d, L): group k gets direction perm[k]
        L = H * W
        ys = []
        for k in range(4):
            seq = xs[:, k].transpose(1, 2)  # (b, L, d)
            proj = seq @ self.x_proj[k].T  # (b, L, R + 2N)
            dt, Bm, Cm = proj.split([self.dt_rank, self.d_state, self.d_state], -1)
            delta = F.softplus(dt @ self.dt_proj_weight[k].T + self.dt_proj_bias[k])  # (b, L, d)
            y = selective_scan(seq, delta, -torch.exp(self.A_log[k]), Bm, Cm, self.D[k], self.parallel)
            ys.append(y.transpose(1, 2))  # (b, d, L)
        ys_t = torch.stack(ys, 1)[:, torch.argsort(self.perm)]  # back to direction order with pi^-1
        y = cross_merge(ys_t, H, W).view(b, c, L).transpose(1, 2)  # (b, L, d)
        return self.out_proj(self.out_norm(y)).transpose(1, 2).view(b, c, H, W)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of each pixel of ``x (B, C, H, W)`` (VMamba's ``ln2d``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # (B, C, H, W)


NORMS = ("bn", "gn", "ln2d")


def _norm(kind: str, dim: int) -> nn.Module:
    if kind == "bn":
        return nn.BatchNorm2d(dim)
    if kind == "gn":
        return nn.GroupNorm(min(8, dim), dim)
    if kind == "ln2d":
        return LayerNorm2d(dim)
    raise ValueError(f"TinyVMamba: norm={kind!r}; allowed: {', '.join(NORMS)}")


@shard_unit
class _VSSBlock(nn.Module):
    def __init__(self, dim: int, d_state: int, norm: str, parallel: bool, bias: bool = True) -> None:
        super().__init__()
        self.norm1, self.ss2d = _norm(norm, dim), SS2D(dim, d_state, parallel=parallel, bias=bias)
        self.norm2 = _norm(norm, dim)
        self.mlp = nn.Sequential(nn.Conv2d(dim, 4 * dim, 1), nn.GELU(), nn.Conv2d(4 * dim, dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ss2d(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyVMamba(nn.Module):
    """Stem -> stages of VSS blocks (norm -> SS2D, norm -> MLP), a stride-2 3x3 conv + norm between stages ->
    norm -> mean pool -> linear head.

    One stage by default (the digits model); lists for ``dim`` and ``depth`` give a hierarchical VMamba, e.g.
    the official VMamba-T ``vmamba_tiny_s1l8`` (30.2 M parameters): ``dim=[96, 192, 384, 768]``,
    ``depth=[2, 2, 8, 2]``, ``d_state=1``, ``stem_stride=4``, ``norm="ln2d"``, ``ssm_bias=False``, ``img_size=224``
    (its released weights load after :func:`convert_official_vmamba`, or ``lowrank convert vmamba``).

    Args:
        in_chans: input channels. Default: 1 (grey digits).
        num_classes: outputs. Default: 10.
        dim: channels C, or one per stage. Default: 32.
        depth: VSS blocks, or one count per stage (as many as ``dim``). Default: 2.
        d_state: SSM state size N. Default: 4.
        img_size: input side; the first stage's token grid is ``img_size / stem_stride``. Default: 8.
        stem_stride: 1 or 2 (one 3x3 conv; 2 gives 4 x 4 tokens for 8 x 8 digits, L = 16) or 4 (two stride-2
            3x3 convs with norm and GELU between and a norm after, VMamba's patch-4 stem). Default: 2.
        norm: ``bn`` (BatchNorm), ``gn`` (GroupNorm, batch-size independent) or ``ln2d`` (LayerNorm over channels,
            the official VMamba's). Default: bn.
        parallel_scan: mambapy's parallel scan; False: :func:`linear_scan`, which ``torch.func.vmap`` can batch
            (TRUST's batched parallel mode switches to it by itself). Default: True.
        ssm_bias: biases on the SS2D projections and depthwise conv (the official VMamba-T has none). Default: True.
    """

    def __init__(self, in_chans: int = 1, num_classes: int = 10, dim: int | list[int] = 32, depth: int | list[int] = 2,
                 d_state: int = 4, img_size: int = 8, stem_stride: int = 2, norm: str = "bn", parallel_scan: bool = True,
                 ssm_bias: bool = True) -> None:
        super().__init__()
        dims = [dim] if isinstance(dim, int) else list(dim)
        depths = [depth] * len(dims) if isinstance(depth, int) else list(depth)
        if len(depths) != len(dims) or not dims or min(depths) < 1:
            raise ValueError(f"TinyVMamba: dim={dim!r}, depth={depth!r}; allowed: as many stage depths (>= 1) as stage dims")
        if stem_stride not in (1, 2, 4):
            raise ValueError(f"TinyVMamba: stem_stride={stem_stride!r}; allowed: 1, 2, 4")
        _norm(norm, dims[0])
        self.img_size, self.in_chans = img_size, in_chans
        if stem_stride == 4:
            self.stem: nn.Module = nn.Sequential(nn.Conv2d(in_chans, dims[0] // 2, 3, stride=2, padding=1),
                                                 _norm(norm, dims[0] // 2), nn.GELU(),
                                                 nn.Conv2d(dims[0] // 2, dims[0], 3, stride=2, padding=1),
                                                 _norm(norm, dims[0]))
        else:
            self.stem = nn.Conv2d(in_chans, dims[0], 3, stride=stem_stride, padding=1)
        blocks, downs = [], {}
        for i, (d, n) in enumerate(zip(dims, depths, strict=True)):
            if i:
                downs[str(len(blocks))] = nn.Sequential(nn.Conv2d(dims[i - 1], d, 3, stride=2, padding=1), _norm(norm, d))
            blocks += [_VSSBlock(d, d_state, norm, parallel_scan, ssm_bias) for _ in range(n)]
        self.blocks = nn.ModuleList(blocks)
        self.downsample = nn.ModuleDict(downs)  # key: the index of the block it precedes
        self.norm = _norm(norm, dims[-1])
        self.head = nn.Linear(dims[-1], num_classes)

    def set_traversal(self, perm: object) -> None:
        set_traversal(self, perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:  # flattened square images
            side = int(round(math.sqrt(x.shape[1] / self.in_chans)))
            x = x.view(x.shape[0], self.in_chans, side, side)
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"TinyVMamba: input {tuple(x.shape[-2:])} differs from the trained grid "
                             f"({self.img_size}, {self.img_size})")
        h = self.stem(x)
        for i, block in enumerate(self.blocks):
            if str(i) in self.downsample:
                h = self.downsample[str(i)](h)
            h = block(h)
        return self.head(self.norm(h).mean((2, 3)))


def set_traversal(model: nn.Module, perm: object) -> int:
    """Set the traversal of every SS2D module of ``model``; returns how many.

    Raises:
        ValueError: ``perm`` is not a permutation of 0..3, or ``model`` has no SS2D module.
    """
    p = check_permutation(perm)
    modules = [m for m in model.modules() if isinstance(m, SS2D)]
    if not modules:
        raise ValueError(f"set_traversal: {type(model).__name__} has no SS2D module")
    for m in modules:
        m.set_traversal(p)
    return len(modules)


# ----------------------------------------------------------------------------------------- official weights
def _official_names(depths: list[int]) -> dict[str, str]:
    """Official VMamba (``classification/models/vmamba.py``, channel-first ``ln2d`` models with the v2 patch embed and
    v3 downsampling, as VMamba-T ``vmamba_tiny_s1l8``) parameter name -> this implementation's name."""
    names = {"patch_embed.0": "stem.0", "patch_embed.2": "stem.1", "patch_embed.5": "stem.3", "patch_embed.7": "stem.4",
             "classifier.norm": "norm", "classifier.head": "head"}
    block = 0
    for i, depth in enumerate(depths):
        for j in range(depth):
            src, dst = f"layers.{i}.blocks.{j}", f"blocks.{block}"
            names.update({f"{src}.norm": f"{dst}.norm1", f"{src}.norm2": f"{dst}.norm2", f"{src}.mlp.fc1": f"{dst}.mlp.0",
                          f"{src}.mlp.fc2": f"{dst}.mlp.2"})
            for a, b in (("in_proj", "in_proj"), ("conv2d", "conv2d"), ("out_norm", "out_norm"), ("out_proj", "out_proj"),
                         ("x_proj_weight", "x_proj"), ("dt_projs_weight", "dt_proj_weight"),
                         ("dt_projs_bias", "dt_proj_bias"), ("A_logs", "A_log"), ("Ds", "D")):
                names[f"{src}.op.{a}"] = f"{dst}.ss2d.{b}"
            block += 1
        if i < len(depths) - 1:  # official: at the end of stage i; here: before the first block of stage i + 1
            names[f"layers.{i}.downsample.1"] = f"downsample.{block}.0"
            names[f"layers.{i}.downsample.3"] = f"downsample.{block}.1"
    return names


def convert_official_vmamba(state: dict[str, torch.Tensor], depths: list[int]) -> dict[str, torch.Tensor]:
    """An official VMamba state dict (``torch.load(ckpt)["model"]``) renamed and reshaped for :class:`TinyVMamba`.

    ``A_logs (4 d, N)`` and ``Ds (4 d)`` become ``(4, d, N)`` and ``(4, d)`` (the official layout is group-major);
    ``Linear2d`` weights ``(out, in)`` become 1x1 conv weights where this implementation uses a conv.

    Args:
        state: the official state dict (a ``{"model": ...}`` checkpoint and a ``module.`` prefix are accepted).
        depths: blocks per stage, e.g. ``[2, 2, 8, 2]`` for VMamba-T.

    Raises:
        ValueError: keys that match no official name of that architecture (nothing is dropped silently).
    """
    if "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    names = _official_names(list(depths))
    out, unknown = {}, []
    for key, value in state.items():
        key = key.removeprefix("module.")
        owner, _, leaf = key.rpartition(".")
        if key in names:  # bare parameters (x_proj_weight, A_logs, ...)
            out[names[key]] = value
        elif owner in names:
            out[f"{names[owner]}.{leaf}"] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"convert_official_vmamba: {len(unknown)} keys match no official VMamba name for depths={list(depths)} "
                         f"(first: {unknown[:3]}); check the depths and that the checkpoint is a channel-first ln2d model")
    for key in [k for k in out if k.endswith(("ss2d.A_log", "ss2d.D"))]:
        out[key] = out[key].reshape(4, -1, *out[key].shape[1:])  # (4 d, N) -> (4, d, N); (4 d,) -> (4, d)
    for key in [k for k in out if k.endswith(("ss2d.in_proj.weight", "mlp.0.weight", "mlp.2.weight"))]:
        if out[key].ndim == 2:  # Linear2d (out, in) -> 1x1 conv (out, in, 1, 1)
            out[key] = out[key][:, :, None, None]
    return out
