"""Context parallelism for packed causal sequences: sharded sequences all-gather K/V, local ones run whole.

A micro-batch is a set of sequences; a DACP placement (:func:`lowrank_lit.methods.skrull.dacp_plan`) marks each
as sharded (``-1``: split in ``cp`` contiguous chunks, chunk j on CP rank j) or local to one CP rank. Each rank
packs its tokens as ``(T,)`` with their sequence ids and *global* positions (:func:`pack_for_rank`). In every
attention layer the rank computes q, k, v for its tokens; keys of sharded sequences are all-gathered from the
CP group (:func:`all_gather_cat`, whose backward sums the gradient over the group and keeps this rank's slice),
local sequences attend only to their own rank's keys. The causal mask is ``same sequence and key position <=
query position`` on global positions, so the result equals running every sequence whole in one process.
After the backward pass, parameter gradients are summed over the CP group (:func:`all_reduce_grads`).

:class:`PackedCausalLM` is the tiny causal transformer of the real measurement (pre-norm blocks, learned
positions, ``d_model`` 128, 4 heads, 2 layers by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["chunk_bounds", "pack_for_rank", "all_gather_cat", "all_reduce_grads", "PackedCausalLM", "packed_loss", "cp_loss_backward"]


def chunk_bounds(length: int, cp: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` of each CP rank's chunk of a sharded sequence (the first ranks get the remainder)."""
    base, extra = divmod(length, cp)
    out, start = [], 0
    for j in range(cp):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out


def pack_for_rank(seqs: Sequence[torch.Tensor], placement: Sequence[int], rank: int, cp: int) -> dict[str, torch.Tensor]:
    """This rank's tokens of one micro-batch.

    Returns ``local`` and ``dist`` parts, each a dict of ``tokens`` / ``targets`` (next token of the same sequence,
    -100 at its end) / ``seq`` (index in ``seqs``) / ``pos`` (global position), all ``(T,)``; plus ``dist_sizes``:
    the sharded token count on every CP rank (the all-gather's sizes, known to every rank from the plan).
    """
    def part(items: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        toks, tgts, sid, pos = [], [], [], []
        for k, a, b in items:
            s = seqs[k]
            t = torch.cat([s[1:], s.new_full((1,), -100)])
            toks.append(s[a:b])
            tgts.append(t[a:b])
            sid.append(torch.full((b - a,), k, dtype=torch.long))
            pos.append(torch.arange(a, b))
        if not toks:
            z = torch.zeros(0, dtype=torch.long)
            return {"tokens": z, "targets": z, "seq": z, "pos": z}
        return {"tokens": torch.cat(toks), "targets": torch.cat(tgts), "seq": torch.cat(sid), "pos": torch.cat(pos)}

    local = [(k, 0, len(seqs[k])) for k, p in enumerate(placement) if p == rank]
    sharded = [k for k, p in enumerate(placement) if p < 0]
    mine = [(k, *chunk_bounds(len(seqs[k]), cp)[rank]) for k in sharded]
    sizes = torch.tensor([sum(b - a for a, b in (chunk_bounds(len(seqs[k]), cp)[j] for k in sharded)) for j in range(cp)])
    return {"local": part(local), "dist": part(mine), "dist_sizes": sizes}


class _AllGatherCat(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        ctx.rank = dist.get_rank(group)
        pad = max(sizes)
        padded = torch.zeros((pad, *x.shape[1:]), dtype=x.dtype)
        padded[: len(x)] = x
        bufs = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(bufs, padded.contiguous(), group=group)
        return torch.cat([b[:n] for b, n in zip(bufs, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's gradient w.r.t. every gathered row, summed
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


def all_gather_cat(x: torch.Tensor, sizes: Sequence[int], group: Any = None) -> torch.Tensor:
    """Concatenate ``x`` ``(n_rank, ...)`` of every rank of ``group`` in rank order (``sizes[j]`` rows from rank j);
    differentiable: the backward pass sums the gradient over the group and returns this rank's rows."""
    if not dist.is_available() or not dist.is_initialized() or len(sizes) == 1:
        return x
    return _AllGatherCat.apply(x, [int(s) for s in sizes], group)


def all_reduce_grads(module: nn.Module, group: Any = None) -> None:
    """Sum the parameter gradients over the CP group (each rank computed those of its own tokens)."""
    if not dist.is_available() or not dist.is_initialized():
        return
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qseq: torch.Tensor, qpos: torch.Tensor,
            kseq: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """q ``(H, Tq, dh)``, k/v ``(H, Tk, dh)`` -> ``(H, Tq, dh)``: each query attends to the keys of its own sequence
    at global positions <= its own (queries are packed sequence by sequence, so one attention call per sequence)."""
    if q.shape[1] == 0:
        return q
    ids, counts = torch.unique_consecutive(qseq, return_counts=True)
    outs, start = [], 0
    for sid, n in zip(ids.tolist(), counts.tolist(), strict=True):
        ki = (kseq == sid).nonzero().squeeze(1)
        mask = kpos[ki][None, :] <= qpos[start:start + n][:, None]  # (n, keys of the sequence)
        outs.append(F.scaled_dot_product_attention(q[:, start:start + n], k[:, ki], v[:, ki], attn_mask=mask))
        start += n
    return torch.cat(outs, dim=1)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], self.heads, x.shape[1] // self.heads).transpose(0, 1)  # (T, d) -> (H, T, dh)

    def forward(self, hl: torch.Tensor, hd: torch.Tensor, meta: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        n_local = hl.shape[0]
        q, k, v = self.qkv(self.ln1(torch.cat([hl, hd]))).chunk(3, dim=-1)  # (T, d) each
        out_local = _attend(self._heads(q[:n_local]), self._heads(k[:n_local]), self._heads(v[:n_local]),
                            meta["lseq"], meta["lpos"], meta["lseq"], meta["lpos"])
        kd = all_gather_cat(k[n_local:], meta["sizes"], meta["group"])  # keys of every rank's chunks
        vd = all_gather_cat(v[n_local:], meta["sizes"], meta["group"])
        out_dist = _attend(self._heads(q[n_local:]), self._heads(kd), self._heads(vd), meta["dseq"], meta["dpos"],
                           meta["gseq"], meta["gpos"])
        att = torch.cat([out_local, out_dist], dim=1).transpose(0, 1).reshape(hl.shape[0] + hd.shape[0], -1)
        h = torch.cat([hl, hd]) + self.proj(att)
        h = h + self.mlp(self.ln2(h))
        return h[:n_local], h[n_local:]


class PackedCausalLM(nn.Module):
    """A tiny causal transformer over packed sequences, context-parallel when a CP group is given.

    Args:
        vocab_size: tokens. Default: 256 (bytes).
        d_model: width. Default: 128.
        heads: attention heads. Default: 4.
        layers: blocks. Default: 2.
        max_len: largest position. Default: 4096.
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 128, heads: int = 4, layers: int = 2, max_len: int = 4096) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"PackedCausalLM: d_model={d_model} is not divisible by heads={heads}")
        self.embed, self.pos = nn.Embedding(vocab_size, d_model), nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size)
        self.max_len = max_len

    def forward(self, packed: dict[str, Any], group: Any = None) -> torch.Tensor:
        """Logits ``(T_local + T_dist, vocab)`` of this rank's tokens (local first, then its sharded chunks)."""
        loc, dis = packed["local"], packed["dist"]
        top = max([int(loc["pos"].max()) if len(loc["pos"]) else 0, int(dis["pos"].max()) if len(dis["pos"]) else 0])
        if top >= self.max_len:
            raise ValueError(f"PackedCausalLM: position {top} >= max_len={self.max_len}")
        sizes = [int(s) for s in packed["dist_sizes"]]
        meta = {"lseq": loc["seq"], "lpos": loc["pos"], "dseq": dis["seq"], "dpos": dis["pos"], "sizes": sizes, "group": group,
                "gseq": all_gather_cat(dis["seq"], sizes, group), "gpos": all_gather_cat(dis["pos"], sizes, group)}
        hl = self.embed(loc["tokens"]) + self.pos(loc["pos"])
        hd = self.embed(dis["tokens"]) + self.pos(dis["pos"])
        for block in self.blocks:
            hl, hd = block(hl, hd, meta)
        return self.head(self.norm(torch.cat([hl, hd])))

    @staticmethod
    def targets(packed: dict[str, Any]) -> torch.Tensor:
        return torch.cat([packed["local"]["targets"], packed["dist"]["targets"]])


def packed_loss(model: nn.Module, seqs: Sequence[torch.Tensor], placement: Sequence[int], rank: int, cp: int,
                total_tokens: int | None = None, group: Any = None) -> torch.Tensor:
    """Cross-entropy of one micro-batch on CP rank ``rank``, summed over this rank's next-token targets and divided
    by ``total_tokens`` (the global batch's target count; default: this micro-batch's), so the shares of all ranks
    and micro-batches add up to the global batch's mean token loss. ``model`` takes the packed dict
    (:class:`PackedCausalLM`, or any module with its ``forward(packed, group)`` / ``targets(packed)`` interface)."""
    packed = pack_for_rank(seqs, placement, rank, cp)
    logits = model(packed, group)
    total = total_tokens if total_tokens is not None else sum(len(s) - 1 for s in seqs)
    return F.cross_entropy(logits, model.targets(packed), ignore_index=-100, reduction="sum") / total


def cp_loss_backward(model: PackedCausalLM, seqs: Sequence[torch.Tensor], placement: Sequence[int], rank: int, cp: int,
                     total_tokens: int | None = None, group: Any = None) -> float:
    """:func:`packed_loss` followed by its backward pass. Gradients are left on the parameters (sum them over the CP
    group with :func:`all_reduce_grads` once per global batch). Returns this rank's share of the loss."""
    loss = packed_loss(model, seqs, placement, rank, cp, total_tokens, group)
    loss.backward()
    return float(loss.detach())
