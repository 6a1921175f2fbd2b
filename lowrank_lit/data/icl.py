"""Data for in-context example retrieval: a synthetic ICL world, templated text tasks, a score cache.

The retriever learns from *scored candidates*: for each training query, a set of pool exemplars with the
scorer's loss (lower is better) and one-shot correctness. Evaluation needs, for every test query, the
utility of every pool exemplar (to measure how well the retriever orders the whole pool) and each
exemplar's one-shot correctness (to measure the accuracy of the retrieved top-1).

* :func:`normalised_option_loss` -- stage 1 of the scoring: per-option mean NLL, L1-normalised over the
  options; the candidate's loss is the gold option's share, one-shot correct when the gold option has the
  lowest NLL. Both scorers (the LM scorer and the synthetic oracle) use it.
* :class:`ICLWorld` / :func:`make_icl_world` -- the synthetic world: exemplars ``u = mu_y + 0.8 f_s + eps``
  (class means ``mu``, "format" offsets ``f``), a frozen oracle "LLM" whose logits for query ``x`` after
  exemplar ``e`` are ``W0^T u_x + beta_s * sim(u_e, u_x) * (1 + gamma [s_e = s_x]) * onehot(y_e)`` with
  ``sim = exp(-||u_e - u_x||^2 / 48)``; utility = ``log p(y_x | e, x)``.
* :class:`SyntheticICLDataModule` -- the world's pool, scored candidates per training query, and the
  evaluation matrices.
* :class:`TextICLDataModule` -- templated sentiment exemplars (``"review: the pizza was great . sentiment:
  positive"``), scored by a causal-LM scorer passed in (any object with ``score_matrix``), tokenised for a
  text encoder; or a user's jsonl pool/queries.
* :class:`ScoreCache` -- a resumable jsonl cache of scores keyed by ``(query_id, candidate_id)``, one shard
  per rank.

Training batches are dicts ``{"query": X_q (B, ...), "cands": X_e (B, C, ...), "loss": (B, C), "acc": (B, C)}``;
evaluation batches ``{"query": X_q, "utility": (B, N), "acc": (B, N), "knn": (B, N)}`` over the whole pool of
``N`` exemplars. For text, ``X`` are dicts of token tensors (``input_ids``, ``attention_mask``).
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.tensor import TensorDataModule
from lowrank_lit.data.text_tasks import WORDS, _split_words
from lowrank_lit.seeding import run_seed

__all__ = [
    "normalised_option_loss", "ICLWorld", "make_icl_world", "SyntheticICLDataModule", "TextICLDataModule",
    "ScoreCache", "MatrixScorer", "ICL_LOSSES", "sentiment_records", "read_jsonl", "collate_icl",
]


def normalised_option_loss(option_nll: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 candidate loss from per-option NLLs.

    Args:
        option_nll: ``(..., O)`` mean token NLL of each answer option (>= 0).
        gold: ``(...)`` index of the gold option.

    Returns:
        ``(loss (...), one_shot_acc (...))``: the gold option's share of the L1-normalised NLLs
        (``l_gold / sum_o l_o``, lower is better) and ``[argmin_o l_o = gold]`` as float.

    Raises:
        ValueError: NaN/inf or negative NLLs, or fewer than 2 options.
    """
    if option_nll.shape[-1] < 2:
        raise ValueError(f"normalised_option_loss: option_nll has {option_nll.shape[-1]} option(s); need >= 2")
    if not bool(torch.isfinite(option_nll).all()) or bool((option_nll < 0).any()):
        raise ValueError("normalised_option_loss: option_nll must be finite and >= 0")
    norm = option_nll / option_nll.sum(-1, keepdim=True).clamp_min(1e-12)  # (..., O), sums to 1
    gold = gold.long().unsqueeze(-1)
    loss = norm.gather(-1, gold).squeeze(-1)
    acc = (option_nll.argmin(-1, keepdim=True) == gold).squeeze(-1).float()
    return loss, acc


#: What the synthetic oracle's candidate loss is: the gold NLL, or the option-normalised NLL share.
ICL_LOSSES = ("nll", "normalised")


class MatrixScorer(Protocol):
    """What a data module needs from a scorer: losses and correctness for query x candidate grids."""

    def score_matrix(self, queries: Sequence[Mapping[str, Any]], candidates: Sequence[Mapping[str, Any]],
                     cand_index: torch.Tensor) -> dict[str, torch.Tensor]:
        """``cand_index (Q, C)`` indexes ``candidates``; returns ``{"loss", "one_shot_acc", "utility"}`` each ``(Q, C)``."""


# --------------------------------------------------------------------------------------- synthetic world
@dataclass
class ICLWorld:
    """The synthetic ICL world (see the module docstring). Index tensors are int64, features float32.

    Attributes:
        mu: ``(K, d)`` class means. fmt: ``(S, d)`` format offsets. w0: ``(d, K)`` the oracle's own weights.
        pool: ``{"u": (N, d), "y": (N,), "s": (N,)}`` the exemplar pool.
        splits: ``{"train"|"val"|"test": {"u", "y", "s"}}`` the queries.
        beta_s, gamma, bandwidth: the oracle's exemplar strength, format bonus and similarity bandwidth.
    """

    mu: torch.Tensor
    fmt: torch.Tensor
    w0: torch.Tensor
    pool: dict[str, torch.Tensor]
    splits: dict[str, dict[str, torch.Tensor]]
    beta_s: float
    gamma: float
    bandwidth: float

    @property
    def n_classes(self) -> int:
        return int(self.mu.shape[0])

    @property
    def n_formats(self) -> int:
        return int(self.fmt.shape[0])

    def query_features(self, split: str) -> torch.Tensor:
        """``(Q, d + S)``: ``[u, onehot(format)]`` of a split's queries (their label is unknown to the retriever)."""
        q = self.splits[split]
        return torch.cat([q["u"], F.one_hot(q["s"], self.n_formats).float()], dim=1)

    def exemplar_features(self) -> torch.Tensor:
        """``(N, d + S + K)``: ``[u, onehot(format), onehot(label)]`` of the pool."""
        p = self.pool
        return torch.cat([p["u"], F.one_hot(p["s"], self.n_formats).float(), F.one_hot(p["y"], self.n_classes).float()], 1)

    def logits(self, split: str, query_index: torch.Tensor, cand_index: torch.Tensor) -> torch.Tensor:
        """``(Q, C, K)`` oracle logits for queries ``query_index (Q,)`` after exemplars ``cand_index (Q, C)``."""
        q = self.splits[split]
        ux, sx = q["u"][query_index], q["s"][query_index]  # (Q, d), (Q,)
        ue, se, ye = self.pool["u"][cand_index], self.pool["s"][cand_index], self.pool["y"][cand_index]  # (Q, C, d) ...
        sim = torch.exp(-((ue - ux[:, None]) ** 2).sum(-1) / self.bandwidth)  # (Q, C)
        strength = self.beta_s * sim * (1.0 + self.gamma * (se == sx[:, None]).float())  # (Q, C)
        base = ux @ self.w0  # (Q, K)
        return base[:, None, :] + strength[..., None] * F.one_hot(ye, self.n_classes).float()  # (Q, C, K)

    def score(self, split: str, query_index: torch.Tensor, cand_index: torch.Tensor,
              loss: str = "nll") -> dict[str, torch.Tensor]:
        """``{"loss", "one_shot_acc", "utility"}`` each ``(Q, C)``.

        ``utility = log p(y_x | e, x)``; ``loss`` is ``-utility`` (``"nll"``, the oracle's gold NLL) or the
        option-normalised loss of :func:`normalised_option_loss` (``"normalised"``, the LM scorer's form).
        """
        if loss not in ICL_LOSSES:
            raise ValueError(f"ICLWorld.score: loss={loss!r}; allowed: {', '.join(ICL_LOSSES)}")
        logp = torch.log_softmax(self.logits(split, query_index, cand_index), -1)  # (Q, C, K)
        gold = self.splits[split]["y"][query_index][:, None].expand(cand_index.shape)  # (Q, C)
        norm, acc = normalised_option_loss(-logp, gold)
        utility = logp.gather(-1, gold[..., None]).squeeze(-1)
        return {"loss": -utility if loss == "nll" else norm, "one_shot_acc": acc, "utility": utility}


def make_icl_world(seed: int = 0, n_pool: int = 2000, n_train: int = 800, n_val: int = 0, n_test: int = 500,
                   dim: int = 16, n_classes: int = 4, n_formats: int = 4, format_scale: float = 0.8,
                   noise: float = 1.2, w0_std: float = 0.3, beta_s: float = 3.0, gamma: float = 1.5,
                   bandwidth: float = 48.0) -> ICLWorld:
    """Draw the synthetic world from ``seed`` (class means, formats and ``W0`` ~ N(0, 1), N(0, 1), N(0, w0_std^2)).

    The pool and the query splits are drawn in the order pool, train, test, val, so adding a validation
    split leaves the other draws unchanged. Labels and formats are uniform.
    """
    for name, value in (("n_pool", n_pool), ("n_train", n_train), ("n_test", n_test), ("dim", dim)):
        if value < 1:
            raise ValueError(f"make_icl_world: {name}={value}; allowed: an integer >= 1")
    if n_classes < 2 or n_formats < 1:
        raise ValueError(f"make_icl_world: n_classes={n_classes}, n_formats={n_formats}; allowed: >= 2 and >= 1")
    if n_val < 0:
        raise ValueError(f"make_icl_world: n_val={n_val}; allowed: an integer >= 0")
    g = torch.Generator().manual_seed(int(seed))
    mu = torch.randn(n_classes, dim, generator=g)
    fmt = torch.randn(n_formats, dim, generator=g)
    w0 = w0_std * torch.randn(dim, n_classes, generator=g)

    def draw(n: int) -> dict[str, torch.Tensor]:
        y = torch.randint(n_classes, (n,), generator=g)
        s = torch.randint(n_formats, (n,), generator=g)
        u = mu[y] + format_scale * fmt[s] + noise * torch.randn(n, dim, generator=g)
        return {"u": u, "y": y, "s": s}

    pool = draw(n_pool)
    splits = {"train": draw(n_train), "test": draw(n_test)}
    if n_val:
        splits["val"] = draw(n_val)
    return ICLWorld(mu, fmt, w0, pool, splits, float(beta_s), float(gamma), float(bandwidth))


def collate_icl(items: list[tuple[torch.Tensor, ...]]) -> dict[str, Any]:
    """Stack ``TensorDataset`` items into a training or evaluation batch dict (see the module docstring).

    Training items are ``(query, cands, loss, acc)``; evaluation items ``(query, utility, acc, knn)``;
    text items carry ``(ids, mask)`` pairs in place of ``query`` (and ``cands``).
    """
    cols = [torch.stack(c) for c in zip(*items, strict=True)]
    if len(cols) in (6, 5):  # text: q_ids, q_mask, then (c_ids, c_mask, loss, acc) or (utility, acc, knn)
        query = {"input_ids": cols[0], "attention_mask": cols[1]}
        rest = cols[2:]
        if len(cols) == 6:
            return {"query": query, "cands": {"input_ids": rest[0], "attention_mask": rest[1]}, "loss": rest[2],
                    "acc": rest[3]}
        return {"query": query, "utility": rest[0], "acc": rest[1], "knn": rest[2]}
    if cols[1].ndim == 3:  # (B, C, d) candidate features
        return {"query": cols[0], "cands": cols[1], "loss": cols[2], "acc": cols[3]}
    return {"query": cols[0], "utility": cols[1], "acc": cols[2], "knn": cols[3]}


def _sample_candidates(n_queries: int, n_pool: int, n_candidates: int, g: torch.Generator) -> torch.Tensor:
    """``(Q, C)`` distinct random pool indices per query."""
    if not 2 <= n_candidates <= n_pool:
        raise ValueError(f"n_candidates={n_candidates}; allowed: 2 <= n_candidates <= pool size {n_pool}")
    return torch.stack([torch.randperm(n_pool, generator=g)[:n_candidates] for _ in range(n_queries)])


class SyntheticICLDataModule(TensorDataModule):
    """The synthetic ICL world as a DataModule: scored candidates for training, the whole pool for evaluation.

    Args:
        n_pool: pool exemplars. Default: 2000.
        n_train: training queries. Default: 800.
        n_val: validation queries (0: no validation loop). Default: 0.
        n_test: test queries. Default: 500.
        n_candidates: random pool exemplars scored per training query. Default: 32.
        dim, n_classes, n_formats, format_scale, noise, w0_std, beta_s, gamma, bandwidth: the world
            (see :func:`make_icl_world`). Defaults: 16, 4, 4, 0.8, 1.2, 0.3, 3.0, 1.5, 48.0.
        scorer_loss: the candidate loss the pairs are ranked by: ``nll`` (``-log p(y_x | e, x)``, the utility
            itself) or ``normalised`` (the LM scorer's option-normalised share; it orders the pool at Spearman
            ~0.69 with the utility, which caps what a retriever trained on it can reach). Default: nll.
        data_seed: seed of the world and of the candidate draws; None follows ``seed_everything``. Default: None.
        batch_size: queries per batch. Default: 16.
        eval_batch_size: queries per evaluation batch. Default: 100.
        num_workers: DataLoader workers. Default: 0.
    """

    collate_fn = staticmethod(collate_icl)

    def __init__(self, n_pool: int = 2000, n_train: int = 800, n_val: int = 0, n_test: int = 500, n_candidates: int = 32,
                 dim: int = 16, n_classes: int = 4, n_formats: int = 4, format_scale: float = 0.8, noise: float = 1.2,
                 w0_std: float = 0.3, beta_s: float = 3.0, gamma: float = 1.5, bandwidth: float = 48.0,
                 scorer_loss: str = "nll", data_seed: int | None = None, batch_size: int = 16, eval_batch_size: int = 100,
                 num_workers: int = 0) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers)
        if not 2 <= n_candidates <= n_pool:
            raise ValueError(f"SyntheticICLDataModule: n_candidates={n_candidates}; allowed: 2 <= n_candidates <= n_pool={n_pool}")
        self.world_args = dict(n_pool=n_pool, n_train=n_train, n_val=n_val, n_test=n_test, dim=dim, n_classes=n_classes,
                               n_formats=n_formats, format_scale=format_scale, noise=noise, w0_std=w0_std,
                               beta_s=beta_s, gamma=gamma, bandwidth=bandwidth)
        if scorer_loss not in ICL_LOSSES:
            raise ValueError(f"SyntheticICLDataModule: scorer_loss={scorer_loss!r}; allowed: {', '.join(ICL_LOSSES)}")
        self.n_candidates = n_candidates
        self.scorer_loss = scorer_loss
        self.data_seed = data_seed
        self.eval_batch_size = eval_batch_size
        self.world: ICLWorld | None = None
        self.train_candidates: torch.Tensor | None = None

    def _seed(self) -> int:
        return run_seed(self.data_seed)

    def make_splits(self) -> dict[str, Sequence[torch.Tensor] | None]:
        seed = self._seed()
        self.world = world = make_icl_world(seed, **self.world_args)
        g = torch.Generator().manual_seed(seed + 1)
        n_train = world.splits["train"]["u"].shape[0]
        cand = _sample_candidates(n_train, world.pool["u"].shape[0], self.n_candidates, g)  # (Q, C)
        self.train_candidates = cand
        scores = world.score("train", torch.arange(n_train), cand, self.scorer_loss)
        ex = world.exemplar_features()
        train = (world.query_features("train"), ex[cand], scores["loss"], scores["one_shot_acc"])
        return {"train": train, "val": self._eval_split("val"), "test": self._eval_split("test")}

    def _eval_split(self, split: str) -> tuple[torch.Tensor, ...] | None:
        world = self.world
        assert world is not None
        if split not in world.splits:
            return None
        q = world.splits[split]
        n, n_pool = q["u"].shape[0], world.pool["u"].shape[0]
        index = torch.arange(n_pool).expand(n, n_pool)
        scores = world.score(split, torch.arange(n), index)
        knn = -torch.cdist(q["u"], world.pool["u"])  # (Q, N): nearest neighbours in u score highest
        return world.query_features(split), scores["utility"], scores["one_shot_acc"], knn

    def pool_inputs(self) -> torch.Tensor:
        """``(N, d + S + K)`` exemplar-tower inputs of the whole pool."""
        self.setup()
        assert self.world is not None
        return self.world.exemplar_features()



# --------------------------------------------------------------------------------------- text
def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Records of a jsonl file (one JSON object per line; blank lines skipped)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"read_jsonl: {path} does not exist")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sentiment_records(n: int, rng: random.Random, words: dict[str, Sequence[str]] | None = None,
                      start_id: int = 0) -> list[dict[str, Any]]:
    """``n`` templated sentiment records ``{"id", "input", "options", "gold", "text"}``, labels alternating.

    ``input`` is ``"review: the {item} was {adj} . sentiment:"``, options ``[" negative", " positive"]``,
    ``text`` (the exemplar form) is the input followed by the gold option.
    """
    words = words or WORDS
    out = []
    for i in range(n):
        label = i % 2
        adj = rng.choice(words["positive" if label else "negative"])
        inp = f"review: the {rng.choice(words['item'])} was {adj} . sentiment:"
        options = [" negative", " positive"]
        out.append({"id": start_id + i, "input": inp, "options": options, "gold": label, "text": inp + options[label]})
    return out


class ScoreCache:
    """Scores keyed by ``(query_id, candidate_id)`` in jsonl shards ``<dir>/scores.<tag>.jsonl``.

    Each rank appends to its own shard; reading merges every shard, so a rerun (or a run with another
    number of ranks) scores only what is missing.

    Args:
        directory: the cache folder (created on the first write).
        tag: this writer's shard name (``rank0``, ...). Default: ``rank0``.
    """

    def __init__(self, directory: str, tag: str = "rank0") -> None:
        self.directory = directory
        self.tag = tag

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"scores.{self.tag}.jsonl")

    def load(self) -> dict[tuple[str, str], dict[str, float]]:
        """``{(query_id, candidate_id): {"loss", "one_shot_acc", ...}}`` from every shard (str ids)."""
        out: dict[tuple[str, str], dict[str, float]] = {}
        for path in sorted(glob.glob(os.path.join(self.directory, "scores.*.jsonl"))):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut off by an interrupted write: rescored
                    out[(str(rec["query_id"]), str(rec["candidate_id"]))] = {k: v for k, v in rec.items()
                                                                             if k not in ("query_id", "candidate_id")}
        return out

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Append records (each with ``query_id``, ``candidate_id`` and score fields) to this shard."""
        os.makedirs(self.directory, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


def _as_list(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collate scoring jobs as a plain list (records are not tensors)."""
    return items


def _tokens(tokenizer: Any, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    return enc["input_ids"].long(), enc["attention_mask"].long()


class TextICLDataModule(TensorDataModule):
    """Text ICL retrieval data: a pool of exemplars and train/test queries, scored by a causal-LM scorer.

    Records are ``{"id", "input", "options", "gold", "text"}`` (``text``: the exemplar as shown in a prompt,
    question and answer). Without files, templated sentiment records are generated (:func:`sentiment_records`;
    held-out adjectives in the test queries). Scores come from ``scorer.score_matrix`` and are cached in
    ``cache_dir`` (reruns score only what is missing; ``lowrank predict`` with
    ``lowrank_lit.methods.icl_rank_retriever.ICLScoringModule`` fills the same cache across ranks).

    Args:
        scorer: an object with ``score_matrix(queries, candidates, cand_index)`` (e.g.
            ``lowrank_lit.methods.icl_rank_retriever.LikelihoodScorer``); None when every score is in the cache
            or when only listing the jobs for ``lowrank predict``. Default: None.
        tokenizer: tokenizer of the retriever's text encoder. Default: all-MiniLM-L6-v2.
        pool_path, train_path, test_path: jsonl files of records; None generates templated ones. Default: None.
        n_pool, n_train, n_test: sizes of the generated sets. Defaults: 64, 64, 16.
        n_candidates: random pool exemplars scored per training query. Default: 8.
        max_length: encoder tokens per text. Default: 32.
        cache_dir: score cache folder; None keeps scores in memory only. Default: None.
        data_seed: seed of the generated records and the candidate draws; None follows ``seed_everything``.
        batch_size, eval_batch_size, num_workers: loaders. Defaults: 8, 16, 0.
    """

    collate_fn = staticmethod(collate_icl)

    def __init__(self, scorer: MatrixScorer | None = None, tokenizer: str = "all-MiniLM-L6-v2", pool_path: InputPath | None = None,
                 train_path: InputPath | None = None, test_path: InputPath | None = None, n_pool: int = 64, n_train: int = 64,
                 n_test: int = 16, n_candidates: int = 8, max_length: int = 32, cache_dir: str | None = None,
                 data_seed: int | None = None, batch_size: int = 8, eval_batch_size: int = 16,
                 num_workers: int = 0) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers)
        if scorer is not None and not hasattr(scorer, "score_matrix"):
            raise TypeError(f"TextICLDataModule: scorer={type(scorer).__name__} has no score_matrix(queries, candidates, "
                            "cand_index); use lowrank_lit.methods.icl_rank_retriever.LikelihoodScorer")
        if n_candidates < 2:
            raise ValueError(f"TextICLDataModule: n_candidates={n_candidates}; allowed: an integer >= 2")
        self.scorer = scorer
        self.tokenizer_name = tokenizer
        self.paths = {"pool": pool_path, "train": train_path, "test": test_path}
        self.sizes = {"pool": n_pool, "train": n_train, "test": n_test}
        self.n_candidates = n_candidates
        self.max_length = max_length
        self.cache_dir = cache_dir
        self.data_seed = data_seed
        self.eval_batch_size = eval_batch_size
        self.records: dict[str, list[dict[str, Any]]] = {}
        self._pool_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        self._jobs: list[dict[str, Any]] = []

    def _seed(self) -> int:
        return run_seed(self.data_seed)

    def _records(self, seed: int) -> dict[str, list[dict[str, Any]]]:
        rng = random.Random(seed)
        train_words, test_words = {}, {}
        for key in ("positive", "negative"):
            train_words[key], test_words[key] = _split_words(WORDS[key], 0.3, rng)
        train_words["item"] = test_words["item"] = list(WORDS["item"])
        out = {}
        generated = {"pool": (train_words, 0), "train": (train_words, 100_000), "test": (test_words, 200_000)}
        for split, path in self.paths.items():
            if path is not None:
                out[split] = read_jsonl(path)
            else:
                words, start = generated[split]
                out[split] = sentiment_records(self.sizes[split], rng, words, start_id=start)
        for split, recs in out.items():
            for r in recs:
                missing = [k for k in ("id", "input", "options", "gold", "text") if k not in r]
                if missing:
                    raise KeyError(f"TextICLDataModule: a {split} record lacks {missing}; records need id, input, options, "
                                   f"gold and text (got keys {sorted(r)})")
        return out

    def _scores(self, split: str, cand_index: torch.Tensor, known: dict[tuple[str, str], dict[str, float]]
                ) -> dict[str, torch.Tensor]:
        """Scores of ``records[split]`` x pool ``cand_index (Q, C)``: ``known`` (the loaded cache) where present,
        the scorer for the rest (appended to the cache)."""
        queries, pool = self.records[split], self.records["pool"]
        cache = ScoreCache(self.cache_dir) if self.cache_dir else None
        q_n, c_n = cand_index.shape
        out = {k: torch.full((q_n, c_n), float("nan")) for k in ("loss", "one_shot_acc", "utility")}
        todo_rows = []
        for i in range(q_n):
            row = [known.get((str(queries[i]["id"]), str(pool[int(j)]["id"]))) for j in cand_index[i]]
            if all(r is not None for r in row):
                for k in out:
                    out[k][i] = torch.tensor([r[k] for r in row])
            else:
                todo_rows.append(i)
        if todo_rows:
            if self.scorer is None:
                raise ValueError(f"TextICLDataModule: {len(todo_rows)} {split} queries have unscored candidates and scorer=None; "
                                 "pass a scorer or fill the cache first (lowrank predict with ICLScoringModule)")
            rows = torch.tensor(todo_rows)
            fresh = self.scorer.score_matrix([queries[i] for i in todo_rows], pool, cand_index[rows])
            for k in out:
                out[k][rows] = fresh[k].float()
            if cache:
                cache.append({"query_id": queries[i]["id"], "candidate_id": pool[int(j)]["id"],
                              **{k: float(fresh[k][r, c]) for k in out}}
                             for r, i in enumerate(todo_rows) for c, j in enumerate(cand_index[i]))
        return out

    def _plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw the records and the candidates: ``(train candidates (Q, C), test candidates (Q_test, N))``."""
        seed = self._seed()
        self.records = self._records(seed)
        n_pool = len(self.records["pool"])
        g = torch.Generator().manual_seed(seed + 1)
        cand = _sample_candidates(len(self.records["train"]), n_pool, min(self.n_candidates, n_pool), g)
        full = torch.arange(n_pool).expand(len(self.records["test"]), n_pool)
        return cand, full

    def jobs(self) -> list[dict[str, Any]]:
        """The ``{"query", "candidate"}`` record pairs still missing from the cache (what ``lowrank predict`` scores)."""
        cand, full = self._plan()
        known = ScoreCache(self.cache_dir).load() if self.cache_dir else {}
        pool = self.records["pool"]
        out = []
        for split, index in (("train", cand), ("test", full)):
            for q, row in zip(self.records[split], index, strict=True):
                out += [{"query": q, "candidate": pool[int(j)]} for j in row
                        if (str(q["id"]), str(pool[int(j)]["id"])) not in known]
        return out

    def setup(self, stage: str | None = None) -> None:
        if stage == "predict":
            self._jobs = self.jobs()
            return
        super().setup(stage)

    def predict_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(self._jobs, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=_as_list)

    def make_splits(self) -> dict[str, Sequence[torch.Tensor] | None]:
        from lowrank_lit.hub import load_tokenizer

        cand, full = self._plan()
        tok = load_tokenizer(self.tokenizer_name)
        pool = self.records["pool"]
        known = ScoreCache(self.cache_dir).load() if self.cache_dir else {}  # train and test keys are disjoint
        scores = self._scores("train", cand, known)
        p_ids, p_mask = _tokens(tok, [r["text"] for r in pool], self.max_length)
        self._pool_tokens = (p_ids, p_mask)
        q_ids, q_mask = _tokens(tok, [r["input"] for r in self.records["train"]], self.max_length)
        train = (q_ids, q_mask, p_ids[cand], p_mask[cand], scores["loss"], scores["one_shot_acc"])
        test_q = self.records["test"]
        ts = self._scores("test", full, known)
        t_ids, t_mask = _tokens(tok, [r["input"] for r in test_q], self.max_length)
        knn = self._lexical_overlap([r["input"] for r in test_q], [r["text"] for r in pool])
        test = (t_ids, t_mask, ts["utility"], ts["one_shot_acc"], knn)
        return {"train": train, "val": None, "test": test}

    @staticmethod
    def _lexical_overlap(queries: list[str], texts: list[str]) -> torch.Tensor:
        """``(Q, N)`` word-overlap (Jaccard) similarity: the lexical nearest-neighbour baseline."""
        qs = [set(q.split()) for q in queries]
        ts = [set(t.split()) for t in texts]
        return torch.tensor([[len(q & t) / max(1, len(q | t)) for t in ts] for q in qs])

    def pool_inputs(self) -> dict[str, torch.Tensor]:
        """Token tensors ``{"input_ids", "attention_mask"}`` (N, L) of the pool exemplars."""
        self.setup()
        assert self._pool_tokens is not None
        return {"input_ids": self._pool_tokens[0], "attention_mask": self._pool_tokens[1]}

