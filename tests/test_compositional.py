"""The compositional text benchmark: every family's label follows its rule, labels are balanced, the test split
uses held-out words, and the rules are not lexical (the same bag of words carries both labels)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lowrank_lit.data.compositional import (
    COLOURS,
    FAMILIES,
    HEAVY,
    LIGHT,
    NOUNS,
    CompositionalTextDataModule,
    compositional_example,
)
from lowrank_lit.data.text_tasks import WORDS

SINGULAR, PLURAL = {s for s, _ in NOUNS}, {p for _, p in NOUNS}


def reference_label(family: str, text: str) -> int:
    """The rule, read back from the sentence by a parser independent of the generator."""
    w = text.split()
    if family == "order":
        c1, cmp_word, c2 = w[1], w[4], w[7]
        heavier, lighter = (c1, c2) if cmp_word in HEAVY else (c2, c1)
        assert cmp_word in HEAVY + LIGHT
        return int(COLOURS.index(heavier) < COLOURS.index(lighter))
    if family == "negation":
        adj = w[-2] if w[-2] in WORDS["positive"] + WORDS["negative"] else next(x for x in w if x in WORDS["positive"] + WORDS["negative"])
        negations = sum(x in ("not", "never", "nobody") for x in w)
        return int((adj in WORDS["positive"]) != (negations % 2 == 1))
    if family == "parity":
        return int(sum(x in WORDS["food"] for x in w) % 2 == 1)
    if family == "agreement":
        head, verb = w[1], w[5]
        return int((head in PLURAL) == (verb == "are"))
    raise AssertionError(family)


def _dm(**kw):
    return CompositionalTextDataModule(n_train=800, n_val=80, n_test=400, **kw)


def test_every_label_follows_its_rule_and_labels_are_balanced_per_family():
    splits = _dm().texts()
    for name, examples in splits.items():
        counts = Counter((d, y) for _, y, d in examples)
        for d in range(len(FAMILIES)):
            assert abs(counts[d, 0] - counts[d, 1]) <= 1, (name, FAMILIES[d], counts)
        for text, y, d in examples:
            assert reference_label(FAMILIES[d], text) == y, (FAMILIES[d], text, y)


def test_the_test_split_uses_held_out_words_only():
    dm = _dm()
    train, test = dm.word_split()
    for key in ("object", "positive", "negative", "food", "sports", "noun"):
        assert train[key] and test[key] and not set(train[key]) & set(test[key]), key
    test_words = {x for t, _, _ in dm.texts()["test"] for x in t.split()}
    train_only = {x.split("/")[i] for key in ("object", "food", "sports", "noun") for x in train[key]
                  for i in range(len(x.split("/")))}
    assert not test_words & train_only


@pytest.mark.parametrize("family", ["order", "agreement"])
def test_swapping_the_roles_keeps_the_words_and_flips_the_label(family):
    """Order and agreement: the words of a sentence, rearranged, carry the other label."""
    rng = random.Random(0)
    words = _dm().word_split()[0]
    flipped = 0
    for _ in range(200):
        text = compositional_example(family, 1, words, rng)
        w = text.split()
        if family == "order":
            w[1], w[7] = w[7], w[1]
        else:
            if (w[1] in PLURAL) == (w[4] in PLURAL):
                continue  # the same number: the verb agrees with both or neither
            w[1], w[4] = w[4], w[1]
        swapped = " ".join(w)
        assert sorted(swapped.split()) == sorted(text.split())
        assert reference_label(family, swapped) == 0
        flipped += 1
    assert flipped >= 100


@pytest.mark.e2e
def test_a_bag_of_words_classifier_stays_near_chance_on_every_family():
    """Not lexical: logistic regression on word counts, fitted on train, per family on the held-out test split."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression

    splits = CompositionalTextDataModule(n_train=4000, n_val=8, n_test=2000).texts()
    for d, family in enumerate(FAMILIES):
        tr = [(t, y) for t, y, dom in splits["train"] if dom == d]
        te = [(t, y) for t, y, dom in splits["test"] if dom == d]
        vec = CountVectorizer(token_pattern=r"[^ ]+").fit([t for t, _ in tr])
        clf = LogisticRegression(max_iter=2000).fit(vec.transform([t for t, _ in tr]), [y for _, y in tr])
        acc = clf.score(vec.transform([t for t, _ in te]), [y for _, y in te])
        assert acc <= 0.65, (family, acc)


def test_bad_inputs():
    with pytest.raises(ValueError, match="domains=\\['sentiment'\\]; allowed: a non-empty list of order, negation, parity, agreement"):
        CompositionalTextDataModule(domains=["sentiment"])
    with pytest.raises(ValueError, match="agree_mismatch=1.5; allowed: a float in \\[0, 1\\]"):
        CompositionalTextDataModule(agree_mismatch=1.5)
    with pytest.raises(ValueError, match="family='count'; allowed: order, negation, parity, agreement"):
        compositional_example("count", 0, {}, random.Random(0))


# ------------------------------------------------------------------------------------ must show
def _mean(runs: list[dict[str, float]], key: str) -> float:
    import statistics

    return statistics.fmean(r[key] for r in runs)


@pytest.mark.slow
def test_must_show_frozen_features_fail():
    """The benchmark's reason to exist, lower side, over data splits 0-2 on the real all-MiniLM-L6-v2 (all six
    layers): a logistic-regression head on frozen features stays <= 85 % on the two hardest families and <= 90 %
    overall, each judged by the verdict rule over the splits (holds: 56.7 +- 1.5 % overall, 48.9 +- 0.6 % and 52.8 +-
    1.1 % on order and agreement). ``python benchmarks/compositional_ceiling.py --methods head`` prints the same
    table (~1.5 min)."""
    from lowrank_lit.stats import expect_verdict
    from lowrank_lit.studies.peft_suite import linear_probe

    probe = [linear_probe(seed) for seed in (0, 1, 2)]
    hardest = sorted(FAMILIES, key=lambda f: _mean(probe, f))[:2]
    for f in hardest:  # judged by the verdict rule over the splits: 0.85 - accuracy > 0
        expect_verdict("holds", [0.85 - p[f] for p in probe], delta=0.01, claim=f"frozen features <= 85 % on {f}")
    expect_verdict("holds", [0.90 - p["overall"] for p in probe], delta=0.01, claim="frozen features <= 90 % overall")


@pytest.mark.slow
def test_must_show_fine_tuning_solves_it():
    """The upper side, over data split and init seeds 0-2: full fine-tuning (10 epochs, AdamW 5e-5) reaches >= 95 %
    overall and on every family, so the gap adaptation can close is real. Judged by the verdict rule over the three
    seeds it holds overall and on every family but negation, inconclusive (99.6 / 99.8 / 95.8 %: seed 2 is 0.8 points
    above the bar, and three seeds leave an interval of about +-5.6 points).
    ``python benchmarks/compositional_ceiling.py --methods fine_tune`` prints the same table (~40 min)."""
    from lowrank_lit.stats import expect_verdict
    from lowrank_lit.studies.peft_suite import fine_tune

    tuned = [fine_tune(seed) for seed in (0, 1, 2)]
    expect_verdict("holds", [t["overall"] for t in tuned], margin=0.95, delta=0.01, claim="fine-tuning >= 95 % overall")
    for f in FAMILIES:
        expect_verdict("inconclusive" if f == "negation" else "holds", [t[f] for t in tuned], margin=0.95, delta=0.01,
                       claim=f"fine-tuning >= 95 % on {f}")
