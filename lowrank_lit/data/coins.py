"""Coin and dice sequence sources with their exact Bayes-optimal predictors.

Sources over ``V`` symbols (``V = 2``: coins):

* ``dirichlet`` -- each sequence draws its own bias ``theta ~ Dirichlet(alpha)`` and then i.i.d. symbols
  ("random coins" with ``alpha = (1, 1)``); Bayes predictive ``(alpha_v + count_v) / (sum(alpha) + n)``.
* ``categorical`` -- every sequence uses the same bias ("single coin" ``(0.2, 0.8)``); the predictor is the bias.
* ``mixture`` -- each sequence draws a component ``k ~ weights`` and uses its bias ("two-coin mixture"
  ``(0.2, 0.8) / (0.8, 0.2)``, weights 1/2); Bayes predictive = posterior-weighted biases, the posterior over
  components computed in log space (log-sum-exp).

:func:`bayes_log_predictive` returns ``(B, T, V)`` log probabilities of ``x_t`` given ``x_{<t}`` (and an optional
prefix, which is simply conditioned on first). :class:`CoinFlipDataModule` generates sequences on the fly
(:class:`~lowrank_lit.data.stream.SeededBatches`: batch ``i`` of epoch ``e`` from its own seed, so a resumed run
redraws the same batches and every DDP rank has its own stream).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

from lowrank_lit.data.loader import ResumableDataLoader
from lowrank_lit.data.stream import SeededBatches, stream_loader
from lowrank_lit.seeding import run_seed

__all__ = ["SOURCES", "CoinSource", "bayes_log_predictive", "CoinFlipDataModule", "check_tokens"]

SOURCES = ("dirichlet", "categorical", "mixture")


def _simplex(values: Sequence[float], name: str, where: str) -> torch.Tensor:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if t.ndim != 1 or t.numel() < 2 or bool((t < 0).any()) or abs(float(t.sum()) - 1.0) > 1e-6:
        raise ValueError(f"{where}: {name}={list(values)} must be a probability vector (>= 0, summing to 1, >= 2 entries)")
    return t


@dataclass
class CoinSource:
    """A sequence source (see the module docstring).

    Args:
        kind: ``dirichlet`` | ``categorical`` | ``mixture``.
        alpha: Dirichlet concentration (> 0 each). Default: (1, 1).
        bias: the categorical's symbol probabilities. Default: (0.2, 0.8).
        biases: the mixture's component biases, one probability vector each. Default: ((0.2, 0.8), (0.8, 0.2)).
        weights: the mixture's component weights. Default: (0.5, 0.5).

    Raises:
        ValueError: an unknown kind, a bias or weight vector not on the simplex, ``alpha <= 0``, or sizes that
            disagree on the vocabulary.
    """

    kind: str = "dirichlet"
    alpha: Sequence[float] = (1.0, 1.0)
    bias: Sequence[float] = (0.2, 0.8)
    biases: Sequence[Sequence[float]] = ((0.2, 0.8), (0.8, 0.2))
    weights: Sequence[float] = (0.5, 0.5)
    _params: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        where = "CoinSource"
        if self.kind not in SOURCES:
            raise ValueError(f"{where}: kind={self.kind!r}; allowed: {', '.join(SOURCES)}")
        if self.kind == "dirichlet":
            a = torch.tensor([float(v) for v in self.alpha], dtype=torch.float64)
            if a.ndim != 1 or a.numel() < 2 or not bool((a > 0).all()):
                raise ValueError(f"{where}: alpha={list(self.alpha)} must have >= 2 entries, all > 0")
            self._params = {"alpha": a}
        elif self.kind == "categorical":
            self._params = {"bias": _simplex(self.bias, "bias", where)}
        else:
            b = torch.stack([_simplex(row, "biases", where) for row in self.biases])
            w = _simplex(self.weights, "weights", where)
            if w.numel() != b.shape[0]:
                raise ValueError(f"{where}: {w.numel()} weights for {b.shape[0]} mixture components")
            self._params = {"biases": b, "weights": w}

    @property
    def vocab(self) -> int:
        p = self._params
        return int(p["alpha"].numel() if "alpha" in p else p["bias"].numel() if "bias" in p else p["biases"].shape[1])

    def sample(self, n: int, length: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n, length)`` int64 symbol sequences."""
        if length < 1 or n < 1:
            raise ValueError(f"CoinSource.sample: n={n}, length={length}; allowed: integers >= 1")
        p = self._params
        if generator is None:  # a generator drawn from the global RNG (the gamma sampler below needs one)
            generator = torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))
        if self.kind == "dirichlet":
            gamma = _gamma_draws(p["alpha"], n, generator)  # (n, V); normalised gammas are Dirichlet
            theta = gamma / gamma.sum(-1, keepdim=True)
        elif self.kind == "categorical":
            theta = p["bias"].expand(n, -1)
        else:
            k = torch.multinomial(p["weights"], n, replacement=True, generator=generator)
            theta = p["biases"][k]
        return torch.multinomial(theta.float(), length, replacement=True, generator=generator)

    def log_predictive(self, seqs: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        """See :func:`bayes_log_predictive`."""
        return bayes_log_predictive(self, seqs, prefix)


def _gamma_draws(alpha: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``(n, V)`` Gamma(alpha_v, 1) draws from ``generator`` (Marsaglia-Tsang, boosted for alpha < 1)."""
    out = torch.empty(n, alpha.numel(), dtype=torch.float64)
    for v, a in enumerate(alpha.tolist()):
        boost = a < 1.0
        d = (a + 1.0 if boost else a) - 1.0 / 3.0
        c = 1.0 / math.sqrt(9.0 * d)
        draws = torch.empty(0, dtype=torch.float64)
        while draws.numel() < n:
            z = torch.randn(2 * n, generator=generator, dtype=torch.float64)
            u = torch.rand(2 * n, generator=generator, dtype=torch.float64)
            x = (1 + c * z) ** 3
            ok = (x > 0) & (torch.log(u) < 0.5 * z**2 + d - d * x + d * torch.log(x.clamp_min(1e-300)))
            draws = torch.cat([draws, (d * x)[ok]])
        draws = draws[:n]
        if boost:
            draws = draws * torch.rand(n, generator=generator, dtype=torch.float64) ** (1.0 / a)
        out[:, v] = draws
    return out


def check_tokens(seqs: torch.Tensor, vocab: int, where: str) -> torch.Tensor:
    """``(B, T)`` int64 symbols from symbols or one-hot ``(B, T, V)`` rows.

    Raises:
        ValueError: rows that are not one-hot, symbols outside ``[0, vocab)``, a vocabulary mismatch.
    """
    if seqs.ndim == 3:
        if seqs.shape[-1] != vocab:
            raise ValueError(f"{where}: one-hot sequences have {seqs.shape[-1]} symbols; the vocabulary has {vocab}")
        if not bool(((seqs == 0) | (seqs == 1)).all()) or not bool((seqs.sum(-1) == 1).all()):
            raise ValueError(f"{where}: sequences (B, T, V) must be one-hot (one 1 per row, zeros elsewhere)")
        return seqs.argmax(-1)
    if seqs.ndim != 2 or seqs.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"{where}: sequences must be (B, T) integer symbols or (B, T, V) one-hot; got "
                         f"{tuple(seqs.shape)} {seqs.dtype}")
    if seqs.numel() and (int(seqs.min()) < 0 or int(seqs.max()) >= vocab):
        raise ValueError(f"{where}: symbols must lie in [0, {vocab}); found {int(seqs.min())}..{int(seqs.max())}")
    return seqs.long()


def bayes_log_predictive(source: CoinSource, seqs: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Exact Bayes log predictive ``(B, T, V)``: row ``t`` is ``log p(x_t = v | prefix, x_{<t})``.

    Args:
        source: the source whose prior the predictor conditions.
        seqs: ``(B, T)`` symbols or ``(B, T, V)`` one-hot.
        prefix: ``(K,)`` or ``(B, K)`` symbols conditioned on before the sequence; None or length 0: no prefix.
    """
    v = source.vocab
    x = check_tokens(seqs, v, "bayes_log_predictive")
    b, t = x.shape
    onehot = torch.nn.functional.one_hot(x, v).double()  # (B, T, V)
    before = torch.cumsum(onehot, 1) - onehot  # (B, T, V): counts of x_{<t}
    if prefix is not None and prefix.numel():
        pre = check_tokens(prefix.reshape(-1, prefix.shape[-1]) if prefix.ndim else prefix[None], v, "bayes_log_predictive")
        counts = torch.nn.functional.one_hot(pre, v).double().sum(1)  # (1 or B, V)
        before = before + counts[:, None, :]
    p = source._params
    if source.kind == "dirichlet":
        alpha = p["alpha"]
        return torch.log(alpha + before) - torch.log(alpha.sum() + before.sum(-1, keepdim=True))
    if source.kind == "categorical":
        return torch.log(p["bias"]).expand(b, t, v).clone()
    log_b = torch.log(p["biases"])  # (K, V)
    loglik = before @ log_b.T + torch.log(p["weights"])  # (B, T, K): log w_k + sum_v count_v log b_kv
    post = torch.log_softmax(loglik, -1)  # posterior over components
    return torch.logsumexp(post[..., :, None] + log_b, dim=-2)  # (B, T, V)


class CoinFlipDataModule(pl.LightningDataModule):
    """Coin (or dice) sequences generated on the fly.

    Batches are ``(B, T)`` int64 symbols. Validation and test sequences are fixed (drawn once from the seed).

    Args:
        source: ``dirichlet`` (random coins) | ``categorical`` (single coin) | ``mixture`` (two-coin mixture).
        alpha, bias, biases, weights: the source's parameters (see :class:`CoinSource`).
        length: training sequence length (pretraining 100, tuning 50). Default: 100.
        batch_size: sequences per training batch. Default: 128.
        batches_per_epoch: training batches per epoch. Default: 100.
        eval_length: validation/test sequence length. Default: 200.
        eval_sequences: validation/test sequences. Default: 512.
        eval_batch_size: sequences per evaluation batch. Default: 512.
        data_seed: seed of every draw; None follows ``seed_everything``. Default: None.
    """

    def __init__(self, source: str = "dirichlet", alpha: Sequence[float] = (1.0, 1.0), bias: Sequence[float] = (0.2, 0.8),
                 biases: Sequence[Sequence[float]] = ((0.2, 0.8), (0.8, 0.2)), weights: Sequence[float] = (0.5, 0.5),
                 length: int = 100, batch_size: int = 128, batches_per_epoch: int = 100, eval_length: int = 200,
                 eval_sequences: int = 512, eval_batch_size: int = 512, data_seed: int | None = None) -> None:
        super().__init__()
        self.source = CoinSource(source, alpha, bias, biases, weights)
        for name, value in (("length", length), ("batch_size", batch_size), ("batches_per_epoch", batches_per_epoch),
                            ("eval_length", eval_length), ("eval_sequences", eval_sequences),
                            ("eval_batch_size", eval_batch_size)):
            if int(value) < 1:
                raise ValueError(f"CoinFlipDataModule: {name}={value}; allowed: an integer >= 1")
        self.length, self.batch_size, self.batches_per_epoch = length, batch_size, batches_per_epoch
        self.eval_length, self.eval_sequences, self.eval_batch_size = eval_length, eval_sequences, eval_batch_size
        self.data_seed = data_seed
        self._train: SeededBatches | None = None
        self._eval: torch.Tensor | None = None

    @property
    def vocab(self) -> int:
        return self.source.vocab

    def _seed(self) -> int:
        return run_seed(self.data_seed)

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        seed = self._seed()
        self._train = SeededBatches(self._draw, self.batches_per_epoch, seed)
        self._eval = self.source.sample(self.eval_sequences, self.eval_length, torch.Generator().manual_seed(seed + 7919))

    def _draw(self, generator: torch.Generator) -> torch.Tensor:
        return self.source.sample(self.batch_size, self.length, generator)  # (B, T)

    def train_dataloader(self) -> Any:
        assert self._train is not None
        return stream_loader(self._train)

    def _eval_loader(self) -> Any:
        assert self._eval is not None
        return ResumableDataLoader(self._eval, batch_size=self.eval_batch_size, shuffle=False)

    def val_dataloader(self) -> Any:
        return self._eval_loader()

    def test_dataloader(self) -> Any:
        return self._eval_loader()
