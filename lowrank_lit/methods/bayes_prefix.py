"""Prompting as Bayesian conditioning: meta-trained sequence predictors, prefixes vs weight tuning.

Genewein, Wenliang, Grau-Moya, Ruoss, Orseau, Hutter, *Understanding Prompt Tuning and In-Context Learning
via Meta-Learning*, NeurIPS 2025 (arXiv 2505.17010; official JAX code: google-deepmind/thunnini).

A network meta-trained with log loss on sequences from a family of tasks approximates the family's
Bayes-optimal predictor. A hard prefix can then only move it to states reachable by Bayesian conditioning
(with a Beta(1, 1) prior, ``a`` zeros and ``b`` ones act as a Beta(1 + a, 1 + b) prior: unimodal, at most K
virtual counts); soft prefixes can reach states no token sequence reaches; a multimodal target (a two-coin
mixture) needs weight tuning.

* :class:`SequencePredictor` -- ``embedding Linear(V -> E) -> torso -> unembedding Linear(E -> V)``. Input row 0
  is a zero BOS vector, then the prefix, then ``x_1 .. x_{T-1}``; the output at position ``K + t - 1``
  predicts ``x_t`` and outputs over the prefix are dropped. Real/simplex prefixes are ``(K, V)`` rows entering
  before the embedding; a soft prefix is ``(K, E)`` vectors inserted right after the BOS embedding (a
  :class:`~lowrank_lit.nn.prompts.SoftPrompt`). Torsos: a 1-layer LSTM, or one causal pre-LayerNorm
  Transformer block (sinusoidal positions, LayerNorm on q and k, MLP 4E, no biases, final LayerNorm).
* :class:`MetaPretrainModule` -- log-loss meta-training on a source (random coins).
* :class:`PrefixTuningModule` -- ``method="soft" | "real" | "simplex" | "hard"`` with every weight frozen;
  ``hard`` evaluates all ``V^K`` token prefixes on the tuning batches and keeps the argmin (refused above
  ``hard_cap`` candidates).
* :class:`WeightTuningModule` -- ``method="full" | "embedding" | "unembedding" | "emb_unemb" | "lora"`` (LoRA
  rank 4 on the attention projections, Transformer only, from :mod:`lowrank_lit.nn.lora`).
* :func:`cumulative_regret` and :class:`RegretCurveCallback` -- ``sum_{s <= t}`` of the model's log loss minus
  the reference's (the target's exact Bayes predictor, which for a single coin is the oracle).

Loss: mean over the batch of the summed per-step cross-entropy (cumulative log loss per sequence).
Choices the card leaves open (inferred): prefixes start as random one-hot rows -- for ``simplex`` the logits
are those rows (softmax (0.73, 0.27) for V = 2), for ``soft`` one-hot rows in E dimensions; "untrained"
variants keep the random initial weights frozen; with no ``pretrained`` checkpoint and ``untrained=False``
tuning starts from random weights with a warning.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.checkpoint import load_checkpoint
from lowrank_lit.data.coins import CoinSource, bayes_log_predictive, check_tokens
from lowrank_lit.nn.lora import LoRALinear, inject_adapters
from lowrank_lit.nn.prompts import SoftPrompt
from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    artifact_path,
    log_image,
    markdown_table,
    may_write,
    mean_std,
    new_figure,
    read_runs,
    save_figure,
)
from lowrank_lit.sharding import Shardable

__all__ = [
    "SequencePredictor", "sequence_log_loss", "cumulative_regret", "exact_prefix_curves", "exact_prefix_regret", "MetaPretrainModule",
    "PrefixTuningModule", "WeightTuningModule", "RegretCurveCallback", "summary",
]

PAPER = "Understanding Prompt Tuning and In-Context Learning via Meta-Learning (prompting as Bayesian conditioning)"
TORSOS = ("lstm", "transformer")
PREFIX_METHODS = ("soft", "real", "simplex", "hard")
WEIGHT_METHODS = ("full", "embedding", "unembedding", "emb_unemb", "lora")


# --------------------------------------------------------------------------------------- the predictor
def _sinusoid(length: int, dim: int) -> torch.Tensor:
    """``(length, dim)`` sinusoidal position encodings."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    out = torch.zeros(length, dim)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return out


class CausalBlock(nn.Module):
    """One pre-LayerNorm causal self-attention block with LayerNorm on q and k, MLP 4E, no biases."""

    def __init__(self, embed: int, heads: int) -> None:
        super().__init__()
        if embed % heads:
            raise ValueError(f"CausalBlock: embed={embed} must be divisible by heads={heads}")
        self.heads, self.head_dim = heads, embed // heads
        self.ln1 = nn.LayerNorm(embed, bias=False)
        self.q = nn.Linear(embed, embed, bias=False)
        self.k = nn.Linear(embed, embed, bias=False)
        self.v = nn.Linear(embed, embed, bias=False)
        self.o = nn.Linear(embed, embed, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, bias=False)
        self.ln2 = nn.LayerNorm(embed, bias=False)
        self.mlp = nn.Sequential(nn.Linear(embed, 4 * embed, bias=False), nn.GELU(), nn.Linear(4 * embed, embed, bias=False))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, e = h.shape
        x = self.ln1(h)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # (b, heads, s, d)

        q, k, v = self.q_norm(split(self.q(x))), self.k_norm(split(self.k(x))), split(self.v(x))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, d)
        h = h + self.o(att.transpose(1, 2).reshape(b, s, e))
        return h + self.mlp(self.ln2(h))


class SequencePredictor(nn.Module):
    """Next-symbol predictor over ``V`` symbols with prefix insertion points.

    Args:
        torso: ``lstm`` (1 layer, E units) or ``transformer`` (one causal block). Default: lstm.
        vocab: V, number of symbols. Default: 2.
        embed: E, embedding width (and LSTM units). Default: 128.
        heads: attention heads of the Transformer torso. Default: 4.
        max_len: longest input (BOS + prefix + sequence) the Transformer's positions cover. Default: 1024.
    """

    def __init__(self, torso: str = "lstm", vocab: int = 2, embed: int = 128, heads: int = 4, max_len: int = 1024) -> None:
        super().__init__()
        if torso not in TORSOS:
            raise ValueError(f"SequencePredictor: torso={torso!r}; allowed: {', '.join(TORSOS)}")
        if vocab < 2 or embed < 1:
            raise ValueError(f"SequencePredictor: vocab={vocab}, embed={embed}; allowed: vocab >= 2, embed >= 1")
        self.torso_kind, self.vocab, self.embed_dim, self.max_len = torso, vocab, embed, max_len
        self.embedding = nn.Linear(vocab, embed)
        if torso == "lstm":
            self.torso: nn.Module = nn.LSTM(embed, embed, batch_first=True)
        else:
            self.torso = nn.ModuleDict({"block": CausalBlock(embed, heads), "ln_f": nn.LayerNorm(embed, bias=False)})
            self.register_buffer("positions", _sinusoid(max_len, embed), persistent=False)
        self.unembedding = nn.Linear(embed, vocab)

    def _run_torso(self, h: torch.Tensor) -> torch.Tensor:
        if self.torso_kind == "lstm":
            return self.torso(h)[0]
        s = h.shape[1]
        if s > self.max_len:
            raise ValueError(f"SequencePredictor: input of {s} positions exceeds max_len={self.max_len}")
        h = h + self.positions[:s].to(h.dtype)
        return self.torso["ln_f"](self.torso["block"](h))

    def forward(self, seqs: torch.Tensor, prefix_inputs: torch.Tensor | None = None,
                soft_prefix: SoftPrompt | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)``; row ``t`` predicts ``x_t`` from BOS, the prefix and ``x_{<t}``.

        Args:
            seqs: ``(B, T)`` symbols or ``(B, T, V)`` one-hot.
            prefix_inputs: ``(K, V)`` or ``(B, K, V)`` rows before the embedding (real, simplex, or hard one-hot).
            soft_prefix: a SoftPrompt of width E inserted after the BOS embedding.
        """
        x = check_tokens(seqs, self.vocab, "SequencePredictor")
        b, t = x.shape
        if t < 1:
            raise ValueError("SequencePredictor: sequences must have length >= 1")
        onehot = F.one_hot(x, self.vocab).to(self.embedding.weight.dtype)  # (B, T, V)
        rows = [onehot.new_zeros(b, 1, self.vocab)]  # BOS
        if prefix_inputs is not None:
            pre = prefix_inputs.to(onehot.dtype)
            if pre.shape[-1] != self.vocab:
                raise ValueError(f"SequencePredictor: prefix rows have {pre.shape[-1]} entries; the vocabulary has {self.vocab}")
            rows.append(pre.expand(b, -1, -1) if pre.ndim == 2 else pre)
        rows.append(onehot[:, :-1])
        h = self.embedding(torch.cat(rows, 1))  # (B, 1 + K + T - 1, E)
        k = h.shape[1] - t  # = K: position K (the last prefix row, or BOS) predicts x_1, position K + t - 1 predicts x_t
        if soft_prefix is not None:
            soft = soft_prefix.input_prompt(h, h.new_ones(b, h.shape[1]))  # (B, K_s, E)
            h = torch.cat([h[:, :1], soft, h[:, 1:]], 1)
            k += soft.shape[1]
        out = self.unembedding(self._run_torso(h))  # (B, S, V)
        return out[:, k:]  # (B, T, V): outputs over the prefix dropped


def sequence_log_loss(logits: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``sum_t CE(logits_t, x_t)`` (the cumulative log loss per sequence)."""
    x = seqs if seqs.ndim == 2 else seqs.argmax(-1)
    return F.cross_entropy(logits.transpose(1, 2), x, reduction="none").sum(1).mean()


def cumulative_regret(log_probs: torch.Tensor, seqs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``(T,)`` mean over sequences of ``sum_{s <= t} [-log p_model(x_s) + log p_ref(x_s)]``.

    Args:
        log_probs: ``(B, T, V)`` the model's log predictive (log-softmaxed logits).
        seqs: ``(B, T)`` symbols.
        reference: ``(B, T, V)`` the reference's log predictive (oracle or Bayes).
    """
    if log_probs.shape != reference.shape:
        raise ValueError(f"cumulative_regret: model {tuple(log_probs.shape)} and reference {tuple(reference.shape)} differ")
    idx = seqs.long()[..., None]
    step = reference.double().gather(-1, idx).squeeze(-1) - log_probs.double().gather(-1, idx).squeeze(-1)  # (B, T)
    return step.cumsum(1).mean(0)


def exact_prefix_curves(prior: CoinSource, target: CoinSource, seqs: torch.Tensor, prefix_len: int,
                        cap: int = 100_000) -> tuple[torch.Tensor, list[tuple[int, ...]], torch.Tensor]:
    """Regret curves of the prior's exact Bayes predictor against the target's, with no prefix and every hard prefix.

    Returns:
        ``(none (T,), candidates [V^K prefixes], curves (V^K, T))``.
    """
    v = prior.vocab
    if v**prefix_len > cap:
        raise ValueError(f"exact_prefix_curves: {v}^{prefix_len} prefixes exceed the cap {cap}")
    ref = bayes_log_predictive(target, seqs)
    none = cumulative_regret(bayes_log_predictive(prior, seqs), seqs, ref)
    cands = list(itertools.product(range(v), repeat=prefix_len))
    curves = torch.stack([cumulative_regret(bayes_log_predictive(prior, seqs, torch.tensor(c, dtype=torch.long)), seqs, ref)
                          for c in cands])
    return none, cands, curves


def exact_prefix_regret(prior: CoinSource, target: CoinSource, seqs: torch.Tensor, prefix_len: int,
                        at: int = 50, cap: int = 100_000) -> dict[str, Any]:
    """Exact Bayes baselines: the prior's Bayes predictor with no prefix and with the best hard prefix.

    The best of the ``V^K`` prefixes has the lowest regret at step ``at`` (against the target's Bayes
    predictor) on ``seqs``.

    Returns:
        ``{"none": (T,) curve, "best": (T,) curve, "best_prefix": tuple, "losses": [regret at `at` per prefix]}``.
    """
    none, cands, curves = exact_prefix_curves(prior, target, seqs, prefix_len, cap)
    at = min(at, seqs.shape[1])
    best = int(curves[:, at - 1].argmin())
    return {"none": none, "best": curves[best], "best_prefix": cands[best], "losses": curves[:, at - 1].tolist()}


# --------------------------------------------------------------------------------------- modules
def _check_prefix_len(prefix_len: Any, where: str) -> int:
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"{where}: prefix_len={prefix_len!r}; allowed: an integer >= 0")
    return prefix_len


class _CoinModule(Shardable, pl.LightningModule):
    """Shared evaluation: regret curves against the target's exact Bayes predictor, exact prefix baselines."""

    predictor: SequencePredictor

    def __init__(self, regret_at: Sequence[int] = (50, 200), prior_alpha: Sequence[float] = (1.0, 1.0),
                 baseline_prefix_len: int = 6) -> None:
        super().__init__()
        self.regret_at = tuple(int(t) for t in regret_at)
        if not self.regret_at or min(self.regret_at) < 1:
            raise ValueError(f"{type(self).__name__}: regret_at={list(regret_at)}; allowed: integers >= 1")
        self.prior = CoinSource("dirichlet", alpha=prior_alpha)
        self.baseline_prefix_len = _check_prefix_len(baseline_prefix_len, type(self).__name__)
        self.regret_curves: dict[str, torch.Tensor] = {}
        self._eval: dict[str, list[torch.Tensor]] = {}
        self._exact: list[torch.Tensor] | None = None  # [(1 + V^K, T) size-weighted curve sums, sequence count]

    def predict_logits(self, seqs: torch.Tensor) -> torch.Tensor:
        return self.predictor(seqs)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = sequence_log_loss(self.predict_logits(batch), batch)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=batch.shape[0])
        return loss

    def _target(self) -> CoinSource:
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "source"):
            raise ValueError(f"{type(self).__name__}: evaluation needs a CoinFlipDataModule (its source is the target)")
        return dm.source

    def _eval_step(self, batch: torch.Tensor, stage: str) -> None:
        logp = torch.log_softmax(self.predict_logits(batch).float(), -1)
        ref = bayes_log_predictive(self._target(), batch.cpu()).to(logp.device)
        curve = cumulative_regret(logp, batch, ref)  # (T,)
        self._eval.setdefault(stage, []).append(torch.cat([curve.new_tensor([batch.shape[0]]), curve * batch.shape[0]]))
        self.log(f"{stage}/loss", sequence_log_loss(logp, batch), on_epoch=True, batch_size=batch.shape[0], sync_dist=True)

    def _eval_end(self, stage: str) -> None:
        rows = self._eval.pop(stage, [])
        if not rows:
            return
        total = torch.stack(rows).sum(0)
        total = self.trainer.strategy.reduce(total, reduce_op="sum")
        curve = (total[1:] / total[0]).float()
        self.regret_curves = {"model": curve.cpu()}
        for t in self.regret_at:
            if t <= curve.numel():
                self.log(f"{stage}/regret_t{t}", curve[t - 1])

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._eval_step(batch, "test")
        if self.prior.vocab == self.predictor.vocab:  # exact baselines, summed over batches (weighted by size)
            none, _, curves = exact_prefix_curves(self.prior, self._target(), batch.cpu(), self.baseline_prefix_len)
            n = batch.shape[0]
            part = [torch.cat([none[None], curves]) * n, torch.tensor(float(n), dtype=torch.float64)]  # (1 + V^K, T)
            self._exact = part if self._exact is None else [a + b for a, b in zip(self._exact, part, strict=True)]

    def on_test_epoch_end(self) -> None:
        self._eval_end("test")
        exact, self._exact = self._exact, None
        if exact is None:
            return
        total = self.trainer.strategy.reduce(exact[0].to(self.device), reduce_op="sum").cpu()
        count = self.trainer.strategy.reduce(exact[1].to(self.device), reduce_op="sum").cpu()
        mean = total / count  # (1 + V^K, T)
        at = min(self.regret_at[0], mean.shape[1])
        best = 1 + int(mean[1:, at - 1].argmin())
        for name, row in (("none", 0), ("best", best)):
            curve = mean[row].float()
            self.regret_curves[f"bayes_{name}"] = curve
            for t in self.regret_at:
                if t <= curve.numel():
                    self.log(f"test/bayes_{'noprefix' if name == 'none' else 'besthard'}_regret_t{t}", curve[t - 1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(self).__name__}: nothing to train")
        return torch.optim.Adam(params, lr=self.hparams.lr)


@register_method("bayes_prefix", kind="LightningModule", paper=PAPER, summary="summary", bench="bench")
class MetaPretrainModule(_CoinModule):
    """Meta-train a :class:`SequencePredictor` with log loss on a source (random coins by default).

    Args:
        predictor: the network.
        lr: Adam learning rate (official 1e-3; clip the global norm at 1.0 with ``trainer.gradient_clip_val``).
        regret_at: steps at which ``{val,test}/regret_t<t>`` are logged. Default: (50, 200).
        prior_alpha: the Dirichlet prior of the exact baselines. Default: (1, 1).
        baseline_prefix_len: K of the exact best-hard-prefix baseline logged at test. Default: 6.
    """

    def __init__(self, predictor: SequencePredictor, lr: LearningRate = 1e-3, regret_at: Sequence[int] = (50, 200),
                 prior_alpha: Sequence[float] = (1.0, 1.0), baseline_prefix_len: int = 6) -> None:
        super().__init__(regret_at, prior_alpha, baseline_prefix_len)
        if not lr > 0:
            raise ValueError(f"MetaPretrainModule: lr={lr}; allowed: a float > 0")
        self.save_hyperparameters(ignore=["predictor"], logger=False)
        self.predictor = predictor


def _load_predictor(predictor: SequencePredictor, pretrained: str | None, untrained: bool, where: str) -> None:
    """Load ``predictor.*`` weights of a pretraining checkpoint, or keep the random ones (``untrained``)."""
    if untrained:
        if pretrained is not None:
            raise ValueError(f"{where}: untrained=True and pretrained={pretrained!r}; pick one")
        return
    if pretrained is None:
        warnings.warn(f"{where}: no pretrained checkpoint; tuning starts from random weights "
                      "(pass --model.init_args.pretrained=<ckpt of a MetaPretrainModule run>)", stacklevel=3)
        return
    if not os.path.isfile(pretrained):
        hint = ("; {torso} and {seed} are filled by lowrank fit, in Python give the path itself" if "{" in pretrained
                else " (run a MetaPretrainModule config first)")
        raise FileNotFoundError(f"{where}: pretrained={pretrained} does not exist{hint}")
    state = load_checkpoint(pretrained, f"{where}: pretrained")["state_dict"]
    weights = {k[len("predictor."):]: v for k, v in state.items() if k.startswith("predictor.")}
    if not weights:
        raise ValueError(f"{where}: {pretrained} holds no predictor.* weights (not a MetaPretrainModule checkpoint)")
    predictor.load_state_dict(weights)


class PrefixTuningModule(_CoinModule):
    """Tune only a prefix of a frozen predictor.

    Args:
        predictor: the network (its architecture must match the checkpoint).
        pretrained: checkpoint of a :class:`MetaPretrainModule` run (under ``lowrank``, ``{torso}`` and ``{seed}`` in
            the path are the predictor's torso and the run seed:
            :func:`lowrank_lit.launch.checks.resolve_path_templates`); None with ``untrained=False`` starts from
            random weights (warning). Default: None.
        method: ``soft`` (K x E after the BOS embedding) | ``real`` (K x V before the embedding) | ``simplex``
            (K x V logits, rows softmaxed) | ``hard`` (exhaustive search over V^K token prefixes). Default: soft.
        prefix_len: K (>= 0; 0 is the untouched network). Default: 6.
        lr: Adam learning rate. Default: 5e-3.
        untrained: the "untrained" variant: random, frozen weights. Default: False.
        hard_cap: the most candidates ``hard`` evaluates. Default: 100000.
        hard_batches: tuning batches ``hard`` scores every candidate on; training stops after them. Default: 10.
        regret_at, prior_alpha, baseline_prefix_len: as :class:`MetaPretrainModule`.
    """

    def __init__(self, predictor: SequencePredictor, pretrained: str | None = None, method: str = "soft",
                 prefix_len: int = 6, lr: LearningRate = 5e-3, untrained: bool = False, hard_cap: int = 100_000,
                 hard_batches: int = 10, regret_at: Sequence[int] = (50, 200), prior_alpha: Sequence[float] = (1.0, 1.0),
                 baseline_prefix_len: int = 6) -> None:
        super().__init__(regret_at, prior_alpha, baseline_prefix_len)
        if method not in PREFIX_METHODS:
            raise ValueError(f"PrefixTuningModule: method={method!r}; allowed: {', '.join(PREFIX_METHODS)}")
        k = _check_prefix_len(prefix_len, "PrefixTuningModule")
        v, e = predictor.vocab, predictor.embed_dim
        if method == "hard" and v**k > hard_cap:
            raise ValueError(f"PrefixTuningModule: hard search over {v}^{k} = {v**k} prefixes exceeds hard_cap={hard_cap}; "
                             "use method=soft or real (gradient-based), or a shorter prefix_len")
        self.save_hyperparameters(ignore=["predictor"], logger=False)
        _load_predictor(predictor, pretrained, untrained, "PrefixTuningModule")
        predictor.requires_grad_(False)
        self.predictor, self.method, self.prefix_len = predictor, method, k
        self.soft: SoftPrompt | None = None
        self.rows: nn.Parameter | None = None
        gen = torch.Generator().manual_seed(int(torch.randint(2**31, (1,))))
        if k and method == "soft":
            self.soft = SoftPrompt(prompt_len=k, hidden=e)
            with torch.no_grad():  # random one-hot rows in E dimensions
                self.soft.prompt_embeddings.copy_(F.one_hot(torch.randint(e, (k,), generator=gen), e).float())
        elif k and method in ("real", "simplex"):
            self.rows = nn.Parameter(F.one_hot(torch.randint(v, (k,), generator=gen), v).float())  # (K, V)
        elif k and method == "hard":
            if hard_batches < 1:
                raise ValueError(f"PrefixTuningModule: hard_batches={hard_batches}; allowed: an integer >= 1")
            self.register_buffer("candidates", torch.tensor(list(itertools.product(range(v), repeat=k)), dtype=torch.long))
            self.register_buffer("hard_losses", torch.zeros(v**k, dtype=torch.float64))
            self.register_buffer("hard_count", torch.zeros((), dtype=torch.float64))
            self.register_buffer("hard_choice", torch.zeros(k, dtype=torch.long))

    def prefix_inputs(self) -> torch.Tensor | None:
        """``(K, V)`` rows before the embedding (None for soft or K = 0)."""
        if self.rows is not None:
            return torch.softmax(self.rows, -1) if self.method == "simplex" else self.rows
        if self.method == "hard" and self.prefix_len:
            return F.one_hot(self.hard_choice, self.predictor.vocab).float()
        return None

    def predict_logits(self, seqs: torch.Tensor) -> torch.Tensor:
        return self.predictor(seqs, prefix_inputs=self.prefix_inputs(), soft_prefix=self.soft)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        if self.method != "hard" or not self.prefix_len:
            return super().training_step(batch, batch_idx)
        if int(self.hard_count) >= self.hparams.hard_batches:
            self.trainer.should_stop = True
            return None
        with torch.no_grad():  # every candidate's tuning loss on this batch
            losses = torch.stack([sequence_log_loss(self.predictor(batch, F.one_hot(c, self.predictor.vocab).float()), batch)
                                  for c in self.candidates])
        losses = self.trainer.strategy.reduce(losses, reduce_op="mean")
        self.hard_losses += losses.double()
        self.hard_count += 1
        self.hard_choice.copy_(self.candidates[int(self.hard_losses.argmin())])
        self.log("train/loss", losses.min(), on_step=True, on_epoch=True, prog_bar=True, batch_size=batch.shape[0])
        return None  # no optimizer step: the search only scores

    def configure_optimizers(self) -> Any:
        if self.method == "hard" or not self.prefix_len:
            return None  # nothing gradient-based to train
        params = list(self.soft.parameters()) if self.soft is not None else [self.rows]
        return torch.optim.Adam(params, lr=self.hparams.lr)


class WeightTuningModule(_CoinModule):
    """Tune a subset of a pretrained predictor's weights (no prefix).

    Args:
        predictor: the network.
        pretrained: checkpoint of a :class:`MetaPretrainModule` run (None: random start, warning). Default: None.
        method: ``full`` (everything) | ``embedding`` | ``unembedding`` | ``emb_unemb`` | ``lora`` (rank
            ``lora_rank`` on q, k, v, o of the Transformer block). Default: full.
        lr: Adam learning rate. Default: 5e-3.
        untrained: random weights with a frozen torso (only ``embedding``/``unembedding``/``emb_unemb``). Default: False.
        lora_rank: LoRA rank. Default: 4.
        regret_at, prior_alpha, baseline_prefix_len: as :class:`MetaPretrainModule`.
    """

    def __init__(self, predictor: SequencePredictor, pretrained: str | None = None, method: str = "full",
                 lr: LearningRate = 5e-3, untrained: bool = False, lora_rank: int = 4, regret_at: Sequence[int] = (50, 200),
                 prior_alpha: Sequence[float] = (1.0, 1.0), baseline_prefix_len: int = 6) -> None:
        super().__init__(regret_at, prior_alpha, baseline_prefix_len)
        if method not in WEIGHT_METHODS:
            raise ValueError(f"WeightTuningModule: method={method!r}; allowed: {', '.join(WEIGHT_METHODS)}")
        if untrained and method in ("full", "lora"):
            raise ValueError(f"WeightTuningModule: method={method!r} tunes the torso, but untrained=True freezes it; "
                             "use embedding, unembedding or emb_unemb with an untrained torso")
        if method == "lora" and predictor.torso_kind != "transformer":
            raise ValueError("WeightTuningModule: method='lora' adapts attention projections; the LSTM torso has none "
                             "(use torso=transformer or another method)")
        self.save_hyperparameters(ignore=["predictor"], logger=False)
        _load_predictor(predictor, pretrained, untrained, "WeightTuningModule")
        if method == "lora":
            inject_adapters(predictor.torso, ["block.q", "block.k", "block.v", "block.o"],
                            lambda lin: LoRALinear(lin, r=lora_rank, alpha=float(lora_rank)), owner="WeightTuningModule")
        predictor.requires_grad_(False)
        trainable = {
            "full": lambda n: "lora_" not in n,
            "embedding": lambda n: n.startswith("embedding."),
            "unembedding": lambda n: n.startswith("unembedding."),
            "emb_unemb": lambda n: n.startswith(("embedding.", "unembedding.")),
            "lora": lambda n: "lora_" in n,
        }[method]
        for name, p in predictor.named_parameters():
            p.requires_grad_(trainable(name))
        self.predictor, self.method = predictor, method


# --------------------------------------------------------------------------------------- regret curves
class RegretCurveCallback(Callback):
    """After testing, writes the regret curves (model and exact Bayes baselines) as ``regret.csv`` and ``regret.png``
    in the run directory and logs them to W&B as a line plot."""

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        curves = getattr(pl_module, "regret_curves", {})
        if not curves or not may_write(trainer):
            return
        path = artifact_path(trainer, "regret.csv")
        names = sorted(curves)
        length = min(c.numel() for c in curves.values())
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["t", *names])
            for t in range(length):
                w.writerow([t + 1, *(f"{float(curves[n][t]):.6f}" for n in names)])
        fig, ax = new_figure(figsize=(5, 3.5))
        for n in names:
            ax.plot(range(1, length + 1), curves[n][:length].numpy(), label=n)
        ax.set_xlabel("t")
        ax.set_ylabel("cumulative regret (nats)")
        ax.legend(fontsize=8)
        png = save_figure(fig, artifact_path(trainer, "regret.png"))
        log_image(trainer, "test/regret_curve", png)
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                xs = list(range(1, length + 1))
                logger.experiment.log({"test/regret_lines": wandb.plot.line_series(
                    xs=xs, ys=[curves[n][:length].tolist() for n in names], keys=names, title="cumulative regret",
                    xname="t")})


# --------------------------------------------------------------------------------------- summary
def _label(cfg: dict[str, Any]) -> str:
    args = cfg["model"]["init_args"]
    kind = str(cfg["model"]["class_path"]).rsplit(".", 1)[-1]
    method = args.get("method", "pretrain")
    name = {"PrefixTuningModule": f"{method.capitalize()}PT", "WeightTuningModule": f"{method.capitalize()}WT"}.get(kind, "no tuning")
    return name + (" (untrained)" if args.get("untrained") else "")


def summary(roots: list[str], out: str | None = None) -> str:
    """Regret at t = 50 and t = 200 per target, torso and method (mean over seeds), with the exact Bayes baselines."""
    import statistics

    # (target, torso, row) -> {"t50"|"t200": {key: value}}; a method's runs are keyed by run, the exact
    # baselines (the same in every run of a seed) by seed
    cells: dict[tuple[str, str, str], dict[str, dict[str, float]]] = {}
    curves: dict[tuple[str, str, str], list[list[float]]] = {}
    for run in read_runs(roots, "metrics.csv"):
        values = run.metrics
        if "test/regret_t50" not in values:
            continue
        cfg = run.config
        target = cfg["data"]["init_args"].get("source", "dirichlet")
        torso = cfg["model"]["init_args"]["predictor"]["init_args"].get("torso", "lstm")
        seed = f"seed{cfg.get('seed_everything')}"
        rows = {_label(cfg): (str(run), "test/regret_t50", "test/regret_t200"),
                "exact Bayes, no prefix": (seed, "test/bayes_noprefix_regret_t50", "test/bayes_noprefix_regret_t200"),
                "exact Bayes, best hard prefix": (seed, "test/bayes_besthard_regret_t50", "test/bayes_besthard_regret_t200")}
        for name, (key, k50, k200) in rows.items():
            cell = cells.setdefault((target, torso, name), {"t50": {}, "t200": {}})
            if k50 in values:
                cell["t50"][key] = values[k50]
            if k200 in values:
                cell["t200"][key] = values[k200]
        regret_csv = os.path.join(run, "regret.csv")
        if os.path.isfile(regret_csv):
            with open(regret_csv) as f:
                curves.setdefault((target, torso, _label(cfg)), []).append([float(r["model"]) for r in csv.DictReader(f)])
    if not cells:
        raise FileNotFoundError(f"no finished run with test/regret_t50 under {', '.join(roots)}")

    def fmt(by_key: dict[str, float]) -> str:
        return mean_std(list(by_key.values()), ".3f")

    table = [[t, torso, name, len(c["t50"]), fmt(c["t50"]), fmt(c["t200"])]
             for (t, torso, name), c in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2].startswith("exact"), kv[0][2]))]
    if out and curves:
        targets = sorted({k[0] for k in curves})
        torsos = sorted({k[1] for k in curves})
        fig, axes = new_figure(len(targets), len(torsos), figsize=(5 * len(torsos), 3.5 * len(targets)), squeeze=False)
        for i, tgt in enumerate(targets):
            for j, tor in enumerate(torsos):
                ax = axes[i][j]
                for (t, to, name), cs in sorted(curves.items()):
                    if t == tgt and to == tor:
                        n = min(len(c) for c in cs)
                        mean = [statistics.fmean(c[s] for c in cs) for s in range(n)]
                        ax.plot(range(1, n + 1), mean, label=name)
                ax.set_title(f"target {tgt}, {tor}", fontsize=9)
                ax.set_xlabel("t")
                ax.set_ylabel("cumulative regret (nats)")
                ax.legend(fontsize=7)
        save_figure(fig, out)
    return markdown_table(["target", "torso", "method", "runs", "regret t=50", "regret t=200"], table)


def bench(ctx: Any) -> list[Any]:
    """Training-step time of soft-prefix tuning against full weight tuning of the same predictor (``lowrank bench bayes_prefix``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("bayes_prefix", "soft prefix tuning step (weights frozen)", "full weight tuning step",
                        "configs/bayes_prefix/prefix_soft.yaml", "configs/bayes_prefix/weights_full.yaml",
                        "reported (the prefix still runs the whole predictor backward)")]
