"""lowrank_lit.nn.targets: the one way every method finds and replaces layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowrank_lit.nn.targets import match_modules, match_names, replace_module, split_pattern


def _model():
    block = lambda: nn.ModuleDict({"qkv": nn.Linear(4, 12), "proj": nn.Linear(4, 4)})  # noqa: E731
    return nn.ModuleDict({"blocks": nn.ModuleList([block(), block()]), "Head": nn.Linear(4, 2)})


def test_patterns_select_in_pattern_then_model_order():
    m = _model()
    found = match_modules(m, ["blocks.*.proj", "Head"])
    assert [f.name for f in found] == ["blocks.0.proj", "blocks.1.proj", "Head"]
    assert found[0].module is m["blocks"][0]["proj"]


def test_row_slices():
    found = match_modules(_model(), ["blocks.0.qkv[3]"])
    assert len(found) == 1 and found[0].slices == 3 and found[0].pattern == "blocks.0.qkv"
    assert found[0].rows(12) == [slice(0, 4), slice(4, 8), slice(8, 12)]
    with pytest.raises(ValueError, match="10 rows do not split into 3"):
        found[0].rows(10)
    assert split_pattern("a.b") == ("a.b", 1)
    with pytest.raises(ValueError, match=">= 1"):
        split_pattern("a[0]")


def test_case_sensitive_everywhere():
    with pytest.raises(ValueError, match="'head'"):
        match_modules(_model(), ["head"])
    assert match_names(["Head.weight", "blocks.0.qkv.weight"], ["head*"]) == []
    assert match_names(["Head.weight", "blocks.0.qkv.weight"], ["Head*", "*qkv*"]) == ["Head.weight", "blocks.0.qkv.weight"]


def test_error_names_every_unmatched_pattern():
    with pytest.raises(ValueError) as exc:
        match_modules(_model(), ["blocks.*.proj", "nope", "blocks.*.mlp"], owner="X: targets")
    msg = str(exc.value)
    assert msg.startswith("X: targets: patterns match no module: 'nope', 'blocks.*.mlp'")
    assert "blocks.0.qkv" in msg  # shows what the names look like
    for bad in ("blocks.0.proj", [], None):
        with pytest.raises(ValueError, match="non-empty list"):
            match_modules(_model(), bad)


def test_replace_module_returns_the_old_one():
    m = _model()
    old = m["blocks"][1]["qkv"]
    new = nn.Linear(4, 12)
    assert replace_module(m, "blocks.1.qkv", new) is old
    assert m["blocks"][1]["qkv"] is new
    assert replace_module(m, "Head", nn.Identity()) is not None and isinstance(m["Head"], nn.Identity)
    x = torch.randn(2, 4)
    assert m["Head"](x) is x
    with pytest.raises(ValueError, match="not a submodule"):
        replace_module(m, "blocks.7.qkv", new)
    with pytest.raises(ValueError, match="the model itself"):
        replace_module(m, "", new)
