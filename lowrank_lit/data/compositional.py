"""Sentence classification a frozen encoder's pooled features do not solve: word order, negation scope, parity.

Four task families, each a domain with its own inputs and its own decision rule, all binary (the labels share
the two output slots of :class:`~lowrank_lit.data.text_tasks.TemplatedTextDataModule`, whose splits, label
noise, corruption and HyNoIse copies this module inherits):

* ``order`` -- ``"the red box is heavier than the blue box ."``: label 1 iff the heavier object's colour comes
  first in :data:`COLOURS` (a fixed order to be learned). Swapping the two colours keeps the bag of words and flips
  the label, so only word order separates the classes;
* ``negation`` -- ``"it is not true that the meal was not good ."``: the adjective's polarity, flipped by each of
  zero, one or two negations (an XOR of polarity and negation count);
* ``parity`` -- ``"i bought a cake , a football and some rice ."``: label 1 iff an odd number of the three things
  are food (parity is not linear in the counts a mean of word vectors carries);
* ``agreement`` -- ``"the dog near the cats is quiet ."``: label 1 iff the verb agrees with the head noun (the
  first one); the two nouns differ in number in ``agree_mismatch`` of the sentences, where swapping them keeps the
  bag of words and flips the label.

Objects, adjectives, food / sports words and nouns are split into training and held-out words; the test split
uses held-out words only (colours, comparatives, negation frames and verbs are shared: they carry the rule).
Nothing is downloaded; sentences are deterministic in ``split_seed``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lowrank_lit.data.text_tasks import TemplatedTextDataModule

__all__ = ["CompositionalTextDataModule", "FAMILIES", "COLOURS", "compositional_example"]

FAMILIES = ("order", "negation", "parity", "agreement")

#: the order the ``order`` family's label refers to (shared by every split)
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple", "brown", "pink", "grey", "silver")
HEAVY = ("heavier", "bigger", "larger", "taller", "longer", "wider")
LIGHT = ("lighter", "smaller", "shorter", "narrower", "thinner", "tinier")
OBJECTS = ("box", "bag", "chair", "table", "lamp", "bottle", "stone", "drum", "basket", "crate", "bucket", "vase",
           "jar", "trunk", "barrel", "cart")
#: negation frames by the number of negations they apply to the adjective
NEGATION_FRAMES: dict[int, tuple[str, ...]] = {
    0: ("the {item} was {adj} .", "i found the {item} {adj} .", "everyone agreed the {item} was {adj} ."),
    1: ("the {item} was not {adj} .", "the {item} was never {adj} .", "i did not find the {item} {adj} ."),
    2: ("it is not true that the {item} was not {adj} .", "nobody said the {item} was not {adj} .",
        "i never thought the {item} was not {adj} ."),
}
NOUNS = (("dog", "dogs"), ("cat", "cats"), ("teacher", "teachers"), ("pilot", "pilots"), ("bird", "birds"),
         ("child", "children"), ("student", "students"), ("house", "houses"), ("tree", "trees"), ("doctor", "doctors"),
         ("farmer", "farmers"), ("key", "keys"), ("letter", "letters"), ("girl", "girls"), ("boy", "boys"),
         ("horse", "horses"), ("window", "windows"), ("painter", "painters"), ("river", "rivers"), ("queen", "queens"))
STATES = ("quiet", "loud", "old", "new", "ready", "tired", "famous", "hungry", "busy", "here")


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def compositional_example(family: str, label: int, words: dict[str, Sequence[str]], rng: random.Random,
                          agree_mismatch: float = 0.75) -> str:
    """One sentence of ``family`` whose label is ``label`` (0 or 1), drawn from ``words``."""
    if family == "order":
        c1, c2 = rng.sample(COLOURS, 2)
        obj = rng.choice(words["object"])
        heavy = rng.random() < 0.5
        heavier_colour = c1 if heavy else c2
        other = c2 if heavy else c1
        if (COLOURS.index(heavier_colour) < COLOURS.index(other)) != bool(label):
            c1, c2 = c2, c1  # the same words, the roles swapped: the label follows
        cmp_word = rng.choice(HEAVY if heavy else LIGHT)
        return f"the {c1} {obj} is {cmp_word} than the {c2} {obj} ."
    if family == "negation":
        negations = rng.choice((0, 1, 2))
        positive = bool(label) != (negations % 2 == 1)
        adj = rng.choice(words["positive" if positive else "negative"])
        return rng.choice(NEGATION_FRAMES[negations]).format(item=rng.choice(words["item"]), adj=adj)
    if family == "parity":
        n_food = rng.choice((1, 3) if label else (0, 2))
        kinds = ["food"] * n_food + ["sports"] * (3 - n_food)
        rng.shuffle(kinds)
        things = [rng.choice(words[k]) for k in kinds]
        return f"i bought {_article(things[0])} , {_article(things[1])} and {_article(things[2])} ."
    if family == "agreement":
        head, other = rng.sample(range(len(words["noun"])), 2)
        head_plural = rng.random() < 0.5
        other_plural = (not head_plural) if rng.random() < agree_mismatch else head_plural
        verb_plural = head_plural if label else not head_plural
        nouns = words["noun"]
        n1, n2 = nouns[head].split("/")[int(head_plural)], nouns[other].split("/")[int(other_plural)]
        return f"the {n1} near the {n2} {'are' if verb_plural else 'is'} {rng.choice(STATES)} ."
    raise ValueError(f"compositional_example: family={family!r}; allowed: {', '.join(FAMILIES)}")


class CompositionalTextDataModule(TemplatedTextDataModule):
    """The four families of the module docstring as domains (``domains`` selects them), labels balanced within
    each family, held-out words in the test split. Every argument of :class:`TemplatedTextDataModule` applies
    (``label_noise``, ``corrupt_fraction``, ``noisy_copy_rate`` for the noisy-data methods).

    Args:
        agree_mismatch: share of ``agreement`` sentences whose two nouns differ in number. Default: 0.75.
        max_length: tokens per sentence incl. [CLS]/[SEP]. Default: 16 (the longest sentence is 15 tokens).
        n_train: training sentences over all families. Default: 4000.
        n_test: test sentences. Default: 2000.
    """

    domain_names = FAMILIES

    def __init__(self, *args, agree_mismatch: float = 0.75, max_length: int = 16, n_train: int = 4000,
                 n_test: int = 2000, **kwargs) -> None:
        if not 0.0 <= agree_mismatch <= 1.0:
            raise ValueError(f"CompositionalTextDataModule: agree_mismatch={agree_mismatch}; allowed: a float in [0, 1]")
        super().__init__(*args, max_length=max_length, n_train=n_train, n_test=n_test, **kwargs)
        self.agree_mismatch = agree_mismatch

    def word_lists(self) -> dict[str, Sequence[str]]:
        base = super().word_lists()  # the VADER adjectives with vader=True
        words = {k: base[k] for k in ("item", "positive", "negative", "food", "sports")}
        words["object"] = OBJECTS
        words["noun"] = tuple(f"{s}/{p}" for s, p in NOUNS)
        return words

    def examples(self, n: int, words: dict[str, Sequence[str]], rng: random.Random) -> list[tuple[str, int, int]]:
        out = []
        k = len(self.domain_ids)
        for i in range(n):
            domain, label = self.domain_ids[i % k], (i // k) % 2
            out.append((compositional_example(FAMILIES[domain], label, words, rng, self.agree_mismatch), label, domain))
        rng.shuffle(out)
        return out
