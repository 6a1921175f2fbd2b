"""SeDPO: learning to rank in-context examples with a preference-trained retriever.

Ji, Zhang, Han, Que, Shi, Chao, Zhang, *Learning to Rank for In-Context Example Retrieval*, NeurIPS 2025
(official code: github.com/2022neo/SeDPO_NIPS25, built on Se^2 and DPR).

Prior retrievers (UPRISE, Se^2) are trained as classifiers: the exemplar the LLM likes best is the positive,
the rest negatives. SeDPO builds preference pairs (exemplar ``w`` beats ``l`` when the LLM gives the gold
answer a lower normalised loss after ``w``) and trains the bi-encoder with a DPO-style loss against a frozen
reference retriever, so the whole ordering is learned.

1. **Scoring** (:class:`LikelihoodScorer`, :class:`SyntheticOracleScorer`): prompt ``[e_1..e_j; e; x]``; for
   each answer option ``o`` the mean NLL ``l_o`` of the option's tokens only; the candidate's loss is
   ``l_gold / sum_o l_o`` (:func:`~lowrank_lit.data.icl.normalised_option_loss`, lower is better) and it is
   one-shot correct when ``argmin_o l_o = gold``. A prompt longer than the LM's context is cut from the
   left with a warning; the answer is never cut.
2. **Pairs** (:class:`PreferencePairBuilder`): ``top_bottom`` is the official ``pf=2`` builder -- winners
   are the best-ranked candidates with one-shot accuracy > 0, ``n_pair = min(#winners, top_k, #cands // 2)``,
   losers the ``n_pair`` worst, both shuffled and zipped; a pair with ``loss(w) >= loss(l)`` (the official
   builder emits ``w == l`` when the sets overlap) is dropped. ``random`` is ``pf=3``: random ordered pairs.
3. **Loss** (:func:`sedpo_loss`): with ``s(q, e) = <E_q(q), E_e(e)>`` and the frozen reference ``s_ref``,
   ``L = -log sigmoid(beta [(s(q,w) - s(q,l)) - (s_ref(q,w) - s_ref(q,l))])``. The repository's ``DPOLoss``
   body was not available (inferred from its trainer; in-batch softmax normalisers cancel in this form).
   Baseline (Se^2): :func:`inbatch_infonce_loss` with the top-1 candidate as positive, the worst as hard
   negatives and in-batch negatives (DPR). ``hybrid`` adds both.
4. **Retrieval** (:func:`beam_retrieve`): beam search over the pool, re-encoding ``[chosen; x]`` at each step.

:class:`ICLRetrieverModule` trains the towers; it logs per-query Spearman correlation between retriever
scores and utility over the whole pool (``{val,test}/spearman``), the one-shot accuracy of the retrieved
top-1 (``top1_acc``) and the same for the kNN, random and oracle baselines.

Scoring under DDP: ``lowrank predict`` with :class:`ICLScoringModule` on a
:class:`~lowrank_lit.data.icl.TextICLDataModule` shards the (query, candidate) jobs with Lightning's
distributed sampler; :class:`ScoreCacheWriter` appends each rank's scores to its own cache shard, and a
rerun scores only the missing keys.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torchmetrics.functional import spearman_corrcoef

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.checkpoint import load_checkpoint
from lowrank_lit.data.icl import ICL_LOSSES, ICLWorld, ScoreCache, normalised_option_loss
from lowrank_lit.optim import linear_warmup
from lowrank_lit.registry import register_method
from lowrank_lit.report import artifact_path, markdown_table, new_figure, read_runs, save_figure
from lowrank_lit.sharding import Shardable

__all__ = [
    "sedpo_loss", "sedpo_loss_from_scores", "inbatch_infonce_loss", "PreferencePairBuilder", "LikelihoodScorer",
    "SyntheticOracleScorer", "ICLRetrieverModule", "beam_retrieve", "ICLScoringModule", "ScoreCacheWriter",
    "summary",
]

PAPER = "Learning to Rank for In-Context Example Retrieval (SeDPO)"
LOSSES = ("sedpo", "infonce", "hybrid")
#: ``top_bottom`` = the official "pf=2" builder, ``random`` = "pf=3" random ordered pairs.
PAIR_MODES = ("top_bottom", "random")


# --------------------------------------------------------------------------------------- losses
def _check_beta(beta: float, where: str) -> None:
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"{where}: beta={beta!r}; allowed: a finite float > 0")


def sedpo_loss_from_scores(s_w: torch.Tensor, s_l: torch.Tensor, r_w: torch.Tensor, r_l: torch.Tensor,
                           beta: float = 1.0, reduction: str = "mean") -> torch.Tensor:
    """``-log sigmoid(beta [(s_w - s_l) - (r_w - r_l)])`` from policy scores ``s`` and reference scores ``r`` (all (P,)).

    Raises:
        ValueError: ``beta <= 0``, shapes that differ, NaN/inf scores, an unknown ``reduction``.
    """
    _check_beta(beta, "sedpo_loss")
    shapes = {tuple(t.shape) for t in (s_w, s_l, r_w, r_l)}
    if len(shapes) != 1:
        raise ValueError(f"sedpo_loss: winner/loser/reference scores differ in shape: {sorted(shapes)}")
    for name, t in (("s_w", s_w), ("s_l", s_l), ("r_w", r_w), ("r_l", r_l)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"sedpo_loss: {name} has NaN or inf scores")
    margin = (s_w - s_l) - (r_w - r_l).detach()  # (P,)
    loss = F.softplus(-beta * margin)  # = -log sigmoid(beta * margin)
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise ValueError(f"sedpo_loss: reduction={reduction!r}; allowed: mean, sum, none")


def sedpo_loss(q: torch.Tensor, e_w: torch.Tensor, e_l: torch.Tensor, q_ref: torch.Tensor, e_w_ref: torch.Tensor,
               e_l_ref: torch.Tensor, beta: float = 1.0, reduction: str = "mean") -> torch.Tensor:
    """The SeDPO loss of ``P`` pairs from embeddings.

    Args:
        q, e_w, e_l: ``(P, D)`` policy embeddings of the query, the winner and the loser.
        q_ref, e_w_ref, e_l_ref: ``(P, D)`` the frozen reference retriever's embeddings (no gradient flows into them).
        beta: inverse temperature (> 0; paper: 0.02 paraphrase, 0.01 NLI, 0.05 reading, 0.1 coreference).
        reduction: ``mean`` | ``sum`` | ``none``.

    Raises:
        ValueError: ``beta <= 0``, winner and loser tensors of different shapes, NaN scores.
    """
    _check_beta(beta, "sedpo_loss")
    if e_w.shape != e_l.shape or q.shape != e_w.shape:
        raise ValueError(f"sedpo_loss: q, e_w, e_l must have the same shape (P, D); got {tuple(q.shape)}, "
                         f"{tuple(e_w.shape)}, {tuple(e_l.shape)}")
    if q_ref.shape != q.shape or e_w_ref.shape != e_w.shape or e_l_ref.shape != e_l.shape:
        raise ValueError(f"sedpo_loss: reference embeddings must match the policy's shape {tuple(q.shape)}; got "
                         f"{tuple(q_ref.shape)}, {tuple(e_w_ref.shape)}, {tuple(e_l_ref.shape)}")
    s_w, s_l = (q * e_w).sum(-1), (q * e_l).sum(-1)  # (P,)
    with torch.no_grad():
        r_w, r_l = (q_ref * e_w_ref).sum(-1), (q_ref * e_l_ref).sum(-1)
    return sedpo_loss_from_scores(s_w, s_l, r_w, r_l, beta, reduction)


def inbatch_infonce_loss(q: torch.Tensor, pos: torch.Tensor, hard: torch.Tensor | None = None,
                         labels_offset: int = 0) -> torch.Tensor:
    """DPR / Se^2 InfoNCE: each query against every positive and hard negative of the batch.

    Args:
        q: ``(B, D)`` query embeddings.
        pos: ``(M, D)`` positives (``M >= B``; under DDP the gathered positives of all ranks).
        hard: ``(M, K, D)`` hard negatives per positive, or None.
        labels_offset: index of this batch's first positive in ``pos`` (``rank * B`` under DDP). Default: 0.

    Returns:
        ``F.cross_entropy(q @ [pos; hard]^T, labels_offset + arange(B))``.
    """
    if q.ndim != 2 or pos.ndim != 2 or q.shape[1] != pos.shape[1]:
        raise ValueError(f"inbatch_infonce_loss: q (B, D) and pos (M, D) expected; got {tuple(q.shape)}, {tuple(pos.shape)}")
    ctx = pos if hard is None else torch.cat([pos, hard.reshape(-1, hard.shape[-1])])  # (M + M*K, D)
    logits = q @ ctx.T  # (B, M + M*K)
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("inbatch_infonce_loss: NaN or inf scores")
    target = torch.arange(q.shape[0], device=q.device) + labels_offset
    return F.cross_entropy(logits, target)


# --------------------------------------------------------------------------------------- pairs
class PreferencePairBuilder:
    """Preference pairs from one query's scored candidates.

    Args:
        mode: ``top_bottom`` (official ``pf=2``) or ``random`` (``pf=3``, random ordered pairs). Default: top_bottom.
        top_k: cap on the pairs of ``top_bottom`` (official ``top_k``: 20). Default: 20.
        n_pairs: pairs drawn per query in ``random`` mode. Default: 8.
        score_ratio: fraction of the candidates kept by random sub-sampling first (official SCORE_RATIO). Default: 1.0.

    Raises:
        ValueError: an unknown mode, ``top_k < 1``, ``n_pairs < 1``, ``score_ratio`` outside (0, 1].
    """

    def __init__(self, mode: str = "top_bottom", top_k: int = 20, n_pairs: int = 8, score_ratio: float = 1.0) -> None:
        if mode not in PAIR_MODES:
            raise ValueError(f"PreferencePairBuilder: mode={mode!r}; allowed: {', '.join(PAIR_MODES)}")
        if int(top_k) < 1:
            raise ValueError(f"PreferencePairBuilder: top_k={top_k}; allowed: an integer >= 1")
        if int(n_pairs) < 1:
            raise ValueError(f"PreferencePairBuilder: n_pairs={n_pairs}; allowed: an integer >= 1")
        if not 0.0 < score_ratio <= 1.0:
            raise ValueError(f"PreferencePairBuilder: score_ratio={score_ratio}; allowed: a float in (0, 1]")
        self.mode, self.top_k, self.n_pairs, self.score_ratio = mode, int(top_k), int(n_pairs), float(score_ratio)

    @property
    def max_pairs(self) -> int:
        """Most pairs one query can give."""
        return self.top_k if self.mode == "top_bottom" else self.n_pairs

    def index_pairs(self, loss: torch.Tensor, acc: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(P, 2)`` (winner, loser) indices into the candidates, every pair with ``loss[w] < loss[l]``.

        Args:
            loss: ``(C,)`` candidate losses (lower is better).
            acc: ``(C,)`` one-shot correctness.
            generator: random source of the shuffles; None uses torch's global RNG.

        Raises:
            ValueError: fewer than 2 candidates, NaN losses, shapes that differ.
        """
        if loss.ndim != 1 or acc.shape != loss.shape:
            raise ValueError(f"PreferencePairBuilder: loss and acc must be (C,) of equal shape; got {tuple(loss.shape)}, "
                             f"{tuple(acc.shape)}")
        c = loss.shape[0]
        if c < 2:
            raise ValueError(f"PreferencePairBuilder: {c} candidate(s); a pair needs at least 2")
        if bool(torch.isnan(loss).any()):
            raise ValueError("PreferencePairBuilder: NaN candidate loss")
        idx = torch.arange(c)
        if self.score_ratio < 1.0:
            keep = max(2, int(round(self.score_ratio * c)))
            idx = idx[torch.randperm(c, generator=generator)[:keep]]
        order = idx[torch.argsort(loss[idx], stable=True)]  # best first
        if self.mode == "random":
            n = order.shape[0]
            a = torch.randint(n, (self.n_pairs,), generator=generator)
            b = (a + torch.randint(1, n, (self.n_pairs,), generator=generator)) % n  # b != a
            i, j = order[torch.minimum(a, b)], order[torch.maximum(a, b)]  # lower rank position = better
            pairs = torch.stack([i, j], 1)
        else:
            winners = order[acc[order] > 0]
            n_pair = min(winners.shape[0], self.top_k, order.shape[0] // 2)
            if n_pair == 0:
                return torch.zeros(0, 2, dtype=torch.long)
            w = winners[:n_pair][torch.randperm(n_pair, generator=generator)]
            l_ = order[-n_pair:][torch.randperm(n_pair, generator=generator)]
            pairs = torch.stack([w, l_], 1)
        keep = loss[pairs[:, 0]] < loss[pairs[:, 1]]  # drops w == l and ties
        return pairs[keep]

    def __call__(self, candidates: Sequence[Mapping[str, Any]], generator: torch.Generator | None = None
                 ) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
        """Pairs ``(winner, loser)`` of candidate records (each with ``loss`` and ``one_shot_acc``).

        Raises:
            ValueError: an empty list or fewer than 2 candidates.
            KeyError: a candidate without ``loss`` (``one_shot_acc`` defaults to 1).
        """
        if len(candidates) < 2:
            raise ValueError(f"PreferencePairBuilder: {len(candidates)} candidate(s); a pair needs at least 2")
        for i, cand in enumerate(candidates):
            if "loss" not in cand:
                raise KeyError(f"PreferencePairBuilder: candidate {i} has no 'loss' field (keys: {sorted(cand)}); "
                               "score candidates first (LikelihoodScorer.score)")
        loss = torch.tensor([float(c["loss"]) for c in candidates])
        acc = torch.tensor([float(c.get("one_shot_acc", 1.0)) for c in candidates])
        return [(candidates[int(w)], candidates[int(lo)]) for w, lo in self.index_pairs(loss, acc, generator)]


# --------------------------------------------------------------------------------------- scorers
class SyntheticOracleScorer:
    """The synthetic world's oracle "LLM" behind the scorer interface of :class:`LikelihoodScorer`.

    Records are ``{"id": int}`` (query ids index ``world.splits[split]``, candidate ids the pool).

    Args:
        world: an :class:`~lowrank_lit.data.icl.ICLWorld`.
        split: the split queries come from. Default: ``train``.
        loss: ``nll`` (the gold NLL ``-log p(y_x | e, x)``) or ``normalised`` (the LM scorer's option-normalised
            share). Default: nll.
    """

    def __init__(self, world: ICLWorld, split: str = "train", loss: str = "nll") -> None:
        if split not in world.splits:
            raise ValueError(f"SyntheticOracleScorer: split={split!r}; allowed: {', '.join(world.splits)}")
        if loss not in ICL_LOSSES:
            raise ValueError(f"SyntheticOracleScorer: loss={loss!r}; allowed: {', '.join(ICL_LOSSES)}")
        self.world, self.split, self.loss = world, split, loss

    def score_matrix(self, queries: Sequence[Mapping[str, Any]], candidates: Sequence[Mapping[str, Any]],
                     cand_index: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"loss", "one_shot_acc", "utility"}`` each ``(Q, C)`` for ``cand_index (Q, C)`` into ``candidates``."""
        q = torch.tensor([int(r["id"]) for r in queries])
        pool_ids = torch.tensor([int(r["id"]) for r in candidates])
        return self.world.score(self.split, q, pool_ids[cand_index], self.loss)

    def score(self, query: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]],
              prefix: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
        """One query's candidates scored: ``[{"id", "loss", "one_shot_acc", "utility"}]`` (1-shot: no prefix)."""
        if not candidates:
            raise ValueError("SyntheticOracleScorer.score: empty candidate list")
        if prefix:
            raise ValueError("SyntheticOracleScorer.score: the synthetic oracle is one-shot; prefix must be empty")
        out = self.score_matrix([query], candidates, torch.arange(len(candidates))[None])
        return [{"id": c["id"], **{k: float(v[0, i]) for k, v in out.items()}} for i, c in enumerate(candidates)]


class LikelihoodScorer:
    """Scores in-context exemplars with a frozen causal LM (stage 1 of SeDPO).

    For a query ``{"input", "options", "gold"}`` and exemplars ``{"text"}``, the prompt is
    ``separator.join([prefix texts..., candidate text, query input])`` followed by each option's text;
    ``l_o`` is the mean NLL over the option's tokens only (the prompt's tokens carry no loss).

    Args:
        backbone: HF causal-LM name or local path. Default: ``EleutherAI/gpt-neo-2.7B`` (the paper's).
        backbone_config: build a random-init LM from this config dict instead (tests: a tiny GPT-2). Default: None.
        tokenizer: tokenizer name or path; None uses ``backbone``. Default: None.
        max_length: context length; None takes the model's ``n_positions``/``max_position_embeddings``. Default: None.
        batch_size: sequences per forward pass. Default: 16.
        separator: text between exemplars and the query. Default: newline.
        dtype: ``float32`` | ``float16`` | ``bfloat16`` (the paper scores in fp16 on GPU). Default: float32.
        device: where the LM starts (``cpu``, ``cuda``, ``cuda:1``); under :class:`ICLScoringModule` Lightning
            moves it to each rank's device. Default: cpu.
    """

    DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

    def __init__(self, backbone: str = "EleutherAI/gpt-neo-2.7B", backbone_config: dict[str, Any] | None = None,
                 tokenizer: str | None = None, max_length: int | None = None, batch_size: int = 16,
                 separator: str = "\n", dtype: str = "float32", device: str = "cpu") -> None:
        from lowrank_lit.hub import load_tokenizer
        from lowrank_lit.models.text import load_backbone

        if dtype not in self.DTYPES:
            raise ValueError(f"LikelihoodScorer: dtype={dtype!r}; allowed: {', '.join(self.DTYPES)}")
        if batch_size < 1:
            raise ValueError(f"LikelihoodScorer: batch_size={batch_size}; allowed: an integer >= 1")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"LikelihoodScorer: max_length={max_length!r}; allowed: a positive integer, or None (the model's)")
        self.model, self.pretrained = load_backbone(backbone, causal=True, config=backbone_config)
        self.model.to(device=device, dtype=self.DTYPES[dtype])
        self.tokenizer = load_tokenizer(tokenizer or backbone)
        cfg = self.model.config
        limit = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
        self.max_length = int(max_length if max_length is not None else limit or 2048)
        if limit is not None and self.max_length > limit:
            raise ValueError(f"LikelihoodScorer: max_length={max_length} exceeds the model's context {limit}")
        self.batch_size, self.separator = batch_size, separator
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def build(self, prompt: str, option: str) -> tuple[list[int], int]:
        """Token ids of ``prompt + option`` and the number of option tokens (at the end).

        A sequence longer than ``max_length`` loses prompt tokens from the left, with a warning.

        Raises:
            ValueError: an empty option, or an option alone longer than the context.
        """
        p, o = self._ids(prompt), self._ids(option)
        if not o:
            raise ValueError(f"LikelihoodScorer: option {option!r} has no tokens")
        if len(o) >= self.max_length:
            raise ValueError(f"LikelihoodScorer: option {option[:40]!r} has {len(o)} tokens, not less than the context "
                             f"max_length={self.max_length}")
        excess = len(p) + len(o) - self.max_length
        if excess > 0:
            warnings.warn(f"LikelihoodScorer: prompt of {len(p) + len(o)} tokens exceeds max_length={self.max_length}; "
                          f"cut {excess} tokens from the left (the answer is kept)", stacklevel=2)
            p = p[excess:]
        return p + o, len(o)

    @torch.no_grad()
    def sequence_nll(self, seqs: Sequence[tuple[list[int], int]]) -> torch.Tensor:
        """``(n,)`` mean NLL of the last ``k`` tokens of each ``(ids, k)`` (right-padded batches, loss-masked)."""
        out = []
        for start in range(0, len(seqs), self.batch_size):
            chunk = seqs[start:start + self.batch_size]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            target = torch.zeros_like(ids, dtype=torch.bool)  # answer tokens only
            for i, (seq, k) in enumerate(chunk):
                ids[i, :len(seq)] = torch.tensor(seq)
                attn[i, :len(seq)] = 1
                target[i, len(seq) - k:len(seq)] = True
            device = next(self.model.parameters()).device  # where the LM is now (Lightning may have moved it)
            ids, attn, target = ids.to(device), attn.to(device), target.to(device)
            logits = self.model(input_ids=ids, attention_mask=attn).logits.float()  # (b, s, V)
            nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (b, s-1)
            mask = target[:, 1:].float()
            out.append(((nll * mask).sum(1) / mask.sum(1)).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def prompt(self, query: Mapping[str, Any], candidate: Mapping[str, Any] | None,
               prefix: Sequence[Mapping[str, Any]] = ()) -> str:
        """The prompt text ``[prefix...; candidate; query input]``."""
        parts = [str(p["text"]) for p in prefix] + ([str(candidate["text"])] if candidate is not None else [])
        return self.separator.join([*parts, str(query["input"])])

    def option_nll(self, prompts: Sequence[str], options: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        """Per prompt, ``(O,)`` mean option-token NLL of each of its options."""
        seqs, sizes = [], []
        for prompt, opts in zip(prompts, options, strict=True):
            if len(opts) < 2:
                raise ValueError(f"LikelihoodScorer: a query has {len(opts)} option(s); need >= 2")
            seqs += [self.build(prompt, o) for o in opts]
            sizes.append(len(opts))
        flat = self.sequence_nll(seqs)
        return list(torch.split(flat, sizes))

    def score(self, query: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]],
              prefix: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
        """``[{"id", "loss", "one_shot_acc", "utility", "option_nll"}]`` per candidate, in the given order.

        Raises:
            ValueError: an empty candidate list; KeyError: a query without input/options/gold.
        """
        if not candidates:
            raise ValueError("LikelihoodScorer.score: empty candidate list")
        for key in ("input", "options", "gold"):
            if key not in query:
                raise KeyError(f"LikelihoodScorer.score: the query has no {key!r} field (keys: {sorted(query)})")
        nlls = self.option_nll([self.prompt(query, c, prefix) for c in candidates], [query["options"]] * len(candidates))
        gold = torch.tensor(int(query["gold"]))
        out = []
        for cand, nll in zip(candidates, nlls, strict=True):
            loss, acc = normalised_option_loss(nll, gold)
            out.append({"id": cand.get("id"), "loss": float(loss), "one_shot_acc": float(acc),
                        "utility": float(-nll[int(gold)]), "option_nll": nll.tolist()})
        return out

    def score_matrix(self, queries: Sequence[Mapping[str, Any]], candidates: Sequence[Mapping[str, Any]],
                     cand_index: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"loss", "one_shot_acc", "utility"}`` each ``(Q, C)`` for ``cand_index (Q, C)`` into ``candidates``."""
        rows = [self.score(q, [candidates[int(j)] for j in cand_index[i]]) for i, q in enumerate(queries)]
        return {k: torch.tensor([[r[k] for r in row] for row in rows]) for k in ("loss", "one_shot_acc", "utility")}


# --------------------------------------------------------------------------------------- scoring under `lowrank predict`
class ScoreCacheWriter(BasePredictionWriter):
    """Appends each predict batch's score records to this rank's cache shard (``scores.rank<r>.jsonl``).

    Args:
        cache_dir: the cache folder; None takes the datamodule's ``cache_dir``, else ``<run dir>/score_cache``.
            Default: None.
    """

    def __init__(self, cache_dir: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.cache_dir = cache_dir

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any,
                           batch_indices: Sequence[int] | None, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        directory = self.cache_dir or getattr(trainer.datamodule, "cache_dir", None) or \
            artifact_path(trainer, "score_cache")
        ScoreCache(directory, f"rank{trainer.global_rank}").append(prediction)


class ICLScoringModule(Shardable, pl.LightningModule):
    """``lowrank predict`` over the (query, candidate) jobs of a TextICLDataModule: scores them into its cache.

    Each rank gets a shard of the jobs (Lightning's distributed sampler) and writes its own cache shard;
    jobs already in the cache are not listed, so an interrupted run resumes by running it again.

    Args:
        scorer: a :class:`LikelihoodScorer` (config: ``class_path`` + ``init_args``).
    """

    def __init__(self, scorer: LikelihoodScorer) -> None:
        super().__init__()
        self.scorer = scorer
        self.lm = scorer.model  # registered, so Lightning puts the frozen LM on this rank's device

    def configure_callbacks(self) -> list[pl.Callback]:
        return [ScoreCacheWriter()]

    def predict_step(self, batch: list[dict[str, Any]], batch_idx: int) -> list[dict[str, Any]]:
        out = []
        for job in batch:
            (rec,) = self.scorer.score(job["query"], [job["candidate"]])
            out.append({"query_id": job["query"]["id"], "candidate_id": job["candidate"]["id"],
                        **{k: rec[k] for k in ("loss", "one_shot_acc", "utility")}})
        return out


# --------------------------------------------------------------------------------------- the retriever
def _rows(x: Any, index: torch.Tensor | slice) -> Any:
    """Rows of a tensor or of every tensor in a dict of token tensors."""
    return {k: v[index] for k, v in x.items()} if isinstance(x, dict) else x[index]


def _flatten_cands(x: Any) -> tuple[Any, int, int]:
    """``(B, C, ...)`` candidates (tensor or dict) -> ``(B*C, ...)``, B, C."""
    t = next(iter(x.values())) if isinstance(x, dict) else x
    b, c = int(t.shape[0]), int(t.shape[1])
    flat = {k: v.reshape(b * c, *v.shape[2:]) for k, v in x.items()} if isinstance(x, dict) else x.reshape(b * c, *x.shape[2:])
    return flat, b, c


def _n(x: Any) -> int:
    return int((next(iter(x.values())) if isinstance(x, dict) else x).shape[0])


@register_method("icl_rank_retriever", kind="LightningModule", paper=PAPER, summary="summary", bench="bench")
class ICLRetrieverModule(Shardable, pl.LightningModule):
    """A bi-encoder in-context example retriever trained with SeDPO, InfoNCE or both.

    Batches come from :class:`~lowrank_lit.data.icl.SyntheticICLDataModule` or
    :class:`~lowrank_lit.data.icl.TextICLDataModule` (see :mod:`lowrank_lit.data.icl` for their format).

    Args:
        query_encoder: the query tower, ``inputs -> (n, D)`` (an MLP on vectors, or a
            :class:`~lowrank_lit.models.text.SentenceEncoder`).
        exemplar_encoder: the exemplar tower; None shares the query tower. Default: None.
        loss: ``sedpo`` | ``infonce`` | ``hybrid`` (InfoNCE + ``hybrid_weight`` * SeDPO). Default: sedpo.
        beta: SeDPO inverse temperature (> 0). Default: 1.0.
        pair_mode: ``top_bottom`` (official pf=2) | ``random`` (pf=3). Default: top_bottom.
        top_k: pair cap of ``top_bottom`` (official: 20). Default: 20.
        n_pairs: pairs per query in ``random`` mode. Default: 8.
        score_ratio: candidate sub-sampling before pairing. Default: 1.0.
        n_hard: hard negatives per query for InfoNCE (the worst-scored candidates). Default: 8.
        hybrid_weight: weight of the SeDPO term in ``hybrid``. Default: 1.0.
        lr: Adam learning rate (official text setting: 1e-5). Default: 1e-3.
        adam_eps: Adam epsilon. Default: 1e-8.
        weight_decay: AdamW weight decay. Default: 0.0.
        warmup_steps: linear warm-up steps, then constant (official: 1000). Default: 0.
        init_checkpoint: start from the towers of this checkpoint (e.g. an InfoNCE run), which also become the
            reference. Default: None.
        ref_query_encoder, ref_exemplar_encoder: reference towers; None copies the towers at the start.
            A reference that requires grad is frozen with a warning.
    """

    def __init__(self, query_encoder: nn.Module, exemplar_encoder: nn.Module | None = None, loss: str = "sedpo",
                 beta: float = 1.0, pair_mode: str = "top_bottom", top_k: int = 20, n_pairs: int = 8,
                 score_ratio: float = 1.0, n_hard: int = 8, hybrid_weight: float = 1.0, lr: LearningRate = 1e-3,
                 adam_eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int = 0,
                 init_checkpoint: str | None = None, ref_query_encoder: nn.Module | None = None,
                 ref_exemplar_encoder: nn.Module | None = None) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"ICLRetrieverModule: loss={loss!r}; allowed: {', '.join(LOSSES)}")
        _check_beta(beta, "ICLRetrieverModule")
        if n_hard < 0:
            raise ValueError(f"ICLRetrieverModule: n_hard={n_hard}; allowed: an integer >= 0")
        if not lr > 0:
            raise ValueError(f"ICLRetrieverModule: lr={lr}; allowed: a float > 0")
        if warmup_steps < 0:
            raise ValueError(f"ICLRetrieverModule: warmup_steps={warmup_steps}; allowed: an integer >= 0")
        self.save_hyperparameters(ignore=["query_encoder", "exemplar_encoder", "ref_query_encoder",
                                          "ref_exemplar_encoder"], logger=False)
        self.query_encoder = query_encoder
        self.exemplar_encoder = exemplar_encoder  # None: shared tower
        self.pairs = PreferencePairBuilder(pair_mode, top_k, n_pairs, score_ratio)
        self.loss_name, self.beta, self.n_hard, self.hybrid_weight = loss, float(beta), int(n_hard), float(hybrid_weight)
        if init_checkpoint is not None:
            self.load_towers(init_checkpoint)
        self.ref_query = self._reference(ref_query_encoder, self.query_encoder, "ref_query_encoder")
        self.ref_exemplar = None if exemplar_encoder is None and ref_exemplar_encoder is None else \
            self._reference(ref_exemplar_encoder, self.exemplar_tower, "ref_exemplar_encoder")
        self._pool_emb: torch.Tensor | None = None
        self._top1: list[torch.Tensor] = []  # (B,) retrieved top-1 indices of the test batches

    # ---------------------------------------------------------------- towers
    @property
    def exemplar_tower(self) -> nn.Module:
        return self.exemplar_encoder if self.exemplar_encoder is not None else self.query_encoder

    @staticmethod
    def _reference(given: nn.Module | None, tower: nn.Module, name: str) -> nn.Module:
        if given is None:
            ref = copy.deepcopy(tower)
        else:
            ref = given
            if any(p.requires_grad for p in ref.parameters()):
                warnings.warn(f"ICLRetrieverModule: {name} requires grad; the reference must stay fixed, so it is frozen",
                              stacklevel=3)
        ref.requires_grad_(False)
        ref.eval()
        return ref

    def load_towers(self, path: str) -> None:
        """Load the towers (``query_encoder.*``, ``exemplar_encoder.*``) from a Lightning checkpoint."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ICLRetrieverModule: init_checkpoint={path} does not exist")
        state = load_checkpoint(path, "ICLRetrieverModule: init_checkpoint")["state_dict"]
        towers = {k: v for k, v in state.items() if k.startswith(("query_encoder.", "exemplar_encoder."))}
        missing, _ = self.load_state_dict(towers, strict=False)
        left = [k for k in missing if k.startswith(("query_encoder.", "exemplar_encoder."))]
        if left:
            raise ValueError(f"ICLRetrieverModule: init_checkpoint lacks tower weights, e.g. {left[0]}")

    def train(self, mode: bool = True) -> ICLRetrieverModule:
        super().train(mode)
        self.ref_query.eval()  # the reference never trains (no dropout either)
        if self.ref_exemplar is not None:
            self.ref_exemplar.eval()
        return self

    def encode_queries(self, x: Any, reference: bool = False) -> torch.Tensor:
        return (self.ref_query if reference else self.query_encoder)(x)  # (n, D)

    def encode_exemplars(self, x: Any, reference: bool = False) -> torch.Tensor:
        if reference:
            return (self.ref_exemplar if self.ref_exemplar is not None else self.ref_query)(x)
        return self.exemplar_tower(x)  # (n, D)

    @torch.no_grad()
    def encode_pool(self, pool: Any, chunk: int = 512) -> torch.Tensor:
        """``(N, D)`` exemplar embeddings of the whole pool (tensor or dict of token tensors)."""
        n = _n(pool)
        pool = {k: v.to(self.device) for k, v in pool.items()} if isinstance(pool, dict) else pool.to(self.device)
        return torch.cat([self.encode_exemplars(_rows(pool, slice(i, i + chunk))) for i in range(0, n, chunk)])

    # ---------------------------------------------------------------- training
    def _pair_index(self, loss: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, P, 2)`` winner/loser indices and ``(B, P)`` validity of every query's pairs (padded)."""
        rows = [self.pairs.index_pairs(loss[i].cpu(), acc[i].cpu()) for i in range(loss.shape[0])]
        p = max([1] + [r.shape[0] for r in rows])
        index = torch.zeros(len(rows), p, 2, dtype=torch.long)
        valid = torch.zeros(len(rows), p, dtype=torch.bool)
        for i, r in enumerate(rows):
            index[i, :r.shape[0]] = r
            valid[i, :r.shape[0]] = True
        return index.to(loss.device), valid.to(loss.device)

    def _sedpo(self, batch: dict[str, Any], q: torch.Tensor, e: torch.Tensor, flat: Any) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, d = e.shape
        index, valid = self._pair_index(batch["loss"], batch["acc"])  # (B, P, 2), (B, P)
        with torch.no_grad():
            q_ref = self.encode_queries(batch["query"], reference=True)  # (B, D)
            e_ref = self.encode_exemplars(flat, reference=True).view(b, c, -1)  # (B, C, D)
        rows = torch.arange(b, device=q.device)[:, None].expand_as(valid)[valid]  # (P_total,)
        w, lo = index[..., 0][valid], index[..., 1][valid]
        if rows.numel() == 0:
            zero = q.sum() * 0.0
            return zero, zero.detach()
        loss = sedpo_loss(q[rows], e[rows, w], e[rows, lo], q_ref[rows], e_ref[rows, w], e_ref[rows, lo], self.beta)
        with torch.no_grad():
            pair_acc = ((q[rows] * (e[rows, w] - e[rows, lo])).sum(-1) > 0).float().mean()
        return loss, pair_acc

    def _infonce(self, batch: dict[str, Any], q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        b, c, _ = e.shape
        cand_loss = batch["loss"]
        rows = torch.arange(b, device=q.device)
        pos = e[rows, cand_loss.argmin(1)]  # (B, D) the top-1 candidate
        k = min(self.n_hard, c - 1)
        hard = e[rows[:, None], cand_loss.topk(k, dim=1).indices] if k > 0 else None  # (B, K, D) the worst
        offset = 0
        if self.trainer is not None and self.trainer.world_size > 1:  # in-batch negatives from every rank
            pos = self.all_gather(pos, sync_grads=True).reshape(-1, pos.shape[-1])
            if hard is not None:
                hard = self.all_gather(hard, sync_grads=True).reshape(-1, k, hard.shape[-1])
            offset = self.global_rank * b
        return inbatch_infonce_loss(q, pos, hard, labels_offset=offset)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        q = self.encode_queries(batch["query"])  # (B, D)
        flat, b, c = _flatten_cands(batch["cands"])
        e = self.encode_exemplars(flat).view(b, c, -1)  # (B, C, D)
        total = q.new_zeros(())
        if self.loss_name in ("sedpo", "hybrid"):
            dpo, pair_acc = self._sedpo(batch, q, e, flat)
            total = total + (self.hybrid_weight if self.loss_name == "hybrid" else 1.0) * dpo
            self.log("train/sedpo", dpo, on_step=True, on_epoch=True, batch_size=b)
            self.log("train/pair_acc", pair_acc, on_step=False, on_epoch=True, batch_size=b)
        if self.loss_name in ("infonce", "hybrid"):
            nce = self._infonce(batch, q, e)
            total = total + nce
            self.log("train/infonce", nce, on_step=True, on_epoch=True, batch_size=b)
        self.log("train/loss", total, on_step=True, on_epoch=True, prog_bar=True, batch_size=b)
        return total

    # ---------------------------------------------------------------- evaluation
    def set_pool(self, pool: Any) -> None:
        """Encode the pool now (for use without a datamodule that has ``pool_inputs()``)."""
        self._pool_emb = self.encode_pool(pool)

    def _start_eval(self) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "pool_inputs"):
            self._pool_emb = self.encode_pool(dm.pool_inputs())
        elif self._pool_emb is None:
            raise ValueError("ICLRetrieverModule: no pool to rank; use a datamodule with pool_inputs() or call set_pool()")

    def on_validation_epoch_start(self) -> None:
        self._start_eval()

    def on_test_epoch_start(self) -> None:
        self._start_eval()
        self._top1 = []

    def on_test_epoch_end(self) -> None:
        """``test/top1_distinct``: distinct exemplars retrieved as top-1 per test query (1: every query gets its own;
        small: a few "hub" exemplars win the argmax for many queries); this rank's queries."""
        if self._top1:
            top = torch.cat(self._top1)
            self.log("test/top1_distinct", len(top.unique()) / len(top))

    def _eval_step(self, batch: dict[str, Any], stage: str) -> None:
        assert self._pool_emb is not None
        utility, acc = batch["utility"], batch["acc"]  # (B, N)
        b = utility.shape[0]
        scores = self.encode_queries(batch["query"]) @ self._pool_emb.T  # (B, N)
        rows = torch.arange(b, device=scores.device)

        def log(name: str, value: torch.Tensor) -> None:
            self.log(f"{stage}/{name}", value.float().mean(), on_epoch=True, batch_size=b, sync_dist=True)

        log("spearman", spearman_corrcoef(scores.T.float(), utility.T.float()))  # per query, over the pool
        top = scores.argmax(1)
        log("top1_acc", acc[rows, top])
        log("top1_utility", utility[rows, top])
        # where the retrieved top-1 stands under the scorer: is it the best exemplar, and what share of the pool
        # has a higher utility (0: the best, 0.5: a median exemplar)
        log("top1_is_best", utility[rows, top] >= utility.max(1).values)
        log("top1_utility_rank", (utility > utility[rows, top][:, None]).float().mean(1))
        if stage == "test":
            self._top1.append(top.detach().cpu())
        if stage == "test":
            knn = batch["knn"]
            log("spearman_knn", spearman_corrcoef(knn.T.float(), utility.T.float()))
            log("top1_acc_knn", acc[rows, knn.argmax(1)])
            log("top1_acc_random", acc.float().mean(1))  # expected accuracy of a uniformly drawn exemplar
            log("top1_acc_oracle", acc[rows, utility.argmax(1)])

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise ValueError("ICLRetrieverModule: the towers have no trainable parameter")
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, eps=self.hparams.adam_eps,
                                weight_decay=self.hparams.weight_decay)
        sched = linear_warmup(opt, int(self.hparams.warmup_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# --------------------------------------------------------------------------------------- inference
def beam_retrieve(module: ICLRetrieverModule, query: Any, pool: Any = None, shots: int = 3, beam: int = 3,
                  compose: Callable[[Sequence[int]], Any] | None = None, pool_emb: torch.Tensor | None = None) -> list[int]:
    """Pick ``shots`` pool exemplars for one query by beam search over retriever scores.

    At each step every beam re-encodes its query (``compose(chosen)`` gives the query inputs for
    ``[chosen exemplars; x]``; without it the query inputs are used as they are), scores the pool,
    and extends by its best unchosen exemplars; the ``beam`` highest cumulative scores survive.

    Args:
        module: a trained :class:`ICLRetrieverModule`.
        query: the query's tower inputs for one query (a ``(1, ...)`` tensor or dict of ``(1, s)`` tensors).
        pool: the pool's exemplar-tower inputs (encoded here); unused when ``pool_emb`` is given.
        shots: exemplars to select (>= 1). Default: 3.
        beam: beam width (>= 1). Default: 3.
        compose: ``chosen indices -> query inputs`` of the prefixed query. Default: None.
        pool_emb: ``(N, D)`` precomputed pool embeddings (:meth:`ICLRetrieverModule.encode_pool`). Default: None.

    Returns:
        The chosen pool indices in prompt order (first chosen first).
    """
    if shots < 1 or beam < 1:
        raise ValueError(f"beam_retrieve: shots={shots}, beam={beam}; allowed: integers >= 1")
    with torch.no_grad():
        if pool_emb is None:
            if pool is None:
                raise ValueError("beam_retrieve: give the pool's inputs (pool=) or its embeddings (pool_emb=)")
            pool_emb = module.encode_pool(pool)
        if shots > pool_emb.shape[0]:
            raise ValueError(f"beam_retrieve: shots={shots} exceeds the pool size {pool_emb.shape[0]}")
        beams: list[tuple[float, list[int]]] = [(0.0, [])]
        for _ in range(shots):
            grown: list[tuple[float, list[int]]] = []
            for total, chosen in beams:
                inputs = compose(chosen) if compose is not None else query
                if isinstance(inputs, dict):
                    inputs = {k: v.to(module.device) for k, v in inputs.items()}
                else:
                    inputs = inputs.to(module.device)
                scores = (module.encode_queries(inputs) @ pool_emb.T)[0].clone()  # (N,)
                if chosen:
                    scores[torch.tensor(chosen, device=scores.device)] = -torch.inf
                top = scores.topk(min(beam, int(torch.isfinite(scores).sum())))
                grown += [(total + float(v), [*chosen, int(i)]) for v, i in zip(top.values, top.indices, strict=True)]
            seen, beams = set(), []
            for total, chosen in sorted(grown, key=lambda t: -t[0]):
                key = tuple(sorted(chosen))
                if key not in seen:
                    seen.add(key)
                    beams.append((total, chosen))
                if len(beams) == beam:
                    break
    return beams[0][1]


# --------------------------------------------------------------------------------------- summary
_COLUMNS = ("test/spearman", "test/top1_acc", "test/top1_is_best", "test/top1_utility_rank", "test/top1_distinct")
_BASELINES = (("kNN", "test/spearman_knn", "test/top1_acc_knn"), ("random", None, "test/top1_acc_random"),
              ("oracle", None, "test/top1_acc_oracle"))


def summary(roots: list[str], out: str | None = None) -> str:
    """Markdown table per loss (and the baselines): Spearman over the pool and top-1 accuracy, per seed and mean."""
    import statistics

    rows: dict[str, dict[int, dict[str, float]]] = {}
    for run in read_runs(roots, "metrics.csv"):
        values = run.metrics
        if "test/spearman" not in values:
            continue
        cfg = run.config
        args = cfg["model"]["init_args"]
        name = {"sedpo": "SeDPO", "infonce": "InfoNCE (Se^2)", "hybrid": "hybrid"}[args.get("loss", "sedpo")]
        if args.get("init_checkpoint"):
            name += " (from InfoNCE)"
        seed = int(cfg.get("seed_everything") or 0)
        rows.setdefault(name, {})[seed] = {k: values.get(k, float("nan")) for k in _COLUMNS}
        for base, sp, acc in _BASELINES:  # the baselines depend on the data only
            rows.setdefault(base, {})[seed] = {"test/spearman": values[sp] if sp else float("nan"),
                                               "test/top1_acc": values.get(acc, float("nan"))}
    if not rows:
        raise FileNotFoundError(f"no finished retriever run (with test/spearman) under {', '.join(roots)}")
    seeds = sorted({s for r in rows.values() for s in r})

    def fmt(xs: list[float]) -> str:
        xs = [x for x in xs if not math.isnan(x)]
        return f"{statistics.fmean(xs):.3f}" if xs else "-"

    order = [n for n in ("InfoNCE (Se^2)", "SeDPO", "hybrid") if n in rows] + \
        sorted(n for n in rows if n not in ("InfoNCE (Se^2)", "SeDPO", "hybrid", "kNN", "random", "oracle")) + \
        [n for n in ("kNN", "random", "oracle") if n in rows]
    def spread(xs: list[float]) -> str:
        xs = [x for x in xs if not math.isnan(x)]
        if len(xs) < 2:
            return fmt(xs)
        return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"

    header = ["retriever", "Spearman: mean ± std", "Spearman: " + " / ".join(f"seed {s}" for s in seeds),
              "top-1 acc: mean ± std", "top-1 acc: " + " / ".join(f"seed {s}" for s in seeds)]
    table, diag = [], []
    for name in order:
        per = rows[name]
        sp = [per[s]["test/spearman"] if s in per else float("nan") for s in seeds]
        ac = [per[s]["test/top1_acc"] if s in per else float("nan") for s in seeds]
        table.append([name, spread(sp), " / ".join(fmt([x]) for x in sp), spread(ac), " / ".join(fmt([x]) for x in ac)])
        cols = [[per[s].get(k, float("nan")) if s in per else float("nan") for s in seeds] for k in _COLUMNS[2:]]
        if any(not math.isnan(x) for c in cols for x in c):
            diag.append([name, *(spread(c) for c in cols)])
    if out:
        fig, axes = new_figure(1, 2, figsize=(9, 3.5))
        names = [n for n in order]
        for ax, key, title in ((axes[0], "test/spearman", "Spearman(retriever score, utility) over the pool"),
                               (axes[1], "test/top1_acc", "1-shot accuracy of the retrieved top-1")):
            ax.set_ylabel(key)
            means = [statistics.fmean([v[key] for v in rows[n].values() if not math.isnan(v[key])] or [0.0]) for n in names]
            ax.bar(range(len(names)), means)
            for s in seeds:
                ax.scatter(range(len(names)), [rows[n].get(s, {}).get(key, float("nan")) for n in names], color="k", s=8)
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
            ax.set_title(title, fontsize=9)
        save_figure(fig, out)
    text = markdown_table(header, table)
    if diag:
        text += "\n\nThe retrieved top-1 under the scorer (mean ± std over seeds): the share of queries whose top-1 is the " \
                "exemplar of highest utility, the share of the pool with a higher utility than the top-1, and the " \
                "distinct top-1 exemplars per query:\n\n" + markdown_table(
                    ["retriever", "top-1 is the best", "pool share above the top-1", "distinct top-1 per query"], diag)
    return text


def bench(ctx: Any) -> list[Any]:
    """Training-step time of SeDPO (with its frozen reference encoder) against InfoNCE (``lowrank bench icl_rank_retriever``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("icl_rank_retriever", "SeDPO training step (preference pairs + frozen reference)",
                        "InfoNCE (Se^2) step", "configs/icl_rank_retriever/synthetic_sedpo.yaml",
                        "configs/icl_rank_retriever/synthetic_infonce.yaml", "reported (the reference encoder's forward)")]
