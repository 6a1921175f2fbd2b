"""Every registered method lands whole: configs, a sweep, a docs page with results and commands, tests, a slow must-show.

Parametrized over the registry (as timm's registry drives its tests), so a new method that registers
itself is checked without anyone adding it here.
"""

from __future__ import annotations

import re

import pytest
import yaml

from lowrank_lit import registry
from tests.helpers import ROOT

METHODS = registry.scan_methods()
_NUMBER_CELL = re.compile(r"\|\s*[*+-]*\d")


def _page(slug: str):
    return next((p for p in (ROOT / "docs" / "methods" / f"{slug}.md", ROOT / "docs" / f"{slug}.md") if p.is_file()), None)


def _test_file(slug: str):
    """The method's main test file: ``tests/methods/test_<slug>.py`` or ``tests/methods/<slug>/test_<slug>.py``
    (the baseline, not a paper's method: ``tests/test_baseline.py``)."""
    methods = ROOT / "tests" / "methods"
    candidates = (methods / f"test_{slug}.py", methods / slug / f"test_{slug}.py", ROOT / "tests" / f"test_{slug}.py")
    return next((p for p in candidates if p.is_file()), None)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_method_has_configs_and_a_sweep(method):
    configs = method.configs()
    assert configs, f"no configs/{method.slug}/*.yaml"
    sweeps = []
    for path in sorted((ROOT / "sweeps").glob("*.yaml")):
        command = " ".join(str(c) for c in (yaml.safe_load(path.read_text()) or {}).get("command", []))
        if f"configs/{method.slug}/" in command:
            sweeps.append(path.name)
    assert sweeps, f"no sweeps/*.yaml runs a configs/{method.slug}/ config"


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_method_has_a_docs_page_with_results_and_commands(method):
    page = _page(method.slug)
    assert page is not None, f"no docs/methods/{method.slug}.md"
    text = page.read_text()
    table_rows = [ln for ln in text.splitlines() if ln.startswith("|") and _NUMBER_CELL.search(ln)]
    assert table_rows, f"{page.name}: no results table (a markdown row with a number)"
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert any("lowrank " in b for b in blocks), f"{page.name}: no ```bash block with a lowrank command"
    for slug in re.findall(r"lowrank summarize (\w+)", text):
        from lowrank_lit.launch.summarize import get_summary

        get_summary(slug)  # every summarize command in the docs resolves


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_method_has_tests_and_a_slow_must_show(method):
    path = _test_file(method.slug)
    assert path is not None, f"no tests/methods/test_{method.slug}.py"
    assert "@pytest.mark.slow" in path.read_text(), f"{path.name}: no @pytest.mark.slow must-show test"


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_method_tests_live_in_one_place(method):
    """One home per method: a file ``tests/methods/test_<slug>.py`` or a folder ``tests/methods/<slug>/``, not both,
    and no test module elsewhere imports the method's module at its top (cross-cutting tests import inside a test)."""
    import ast

    slug = method.slug
    methods = ROOT / "tests" / "methods"
    assert not ((methods / f"test_{slug}.py").is_file() and (methods / slug).is_dir()), f"{slug}: a file and a folder"
    home = methods / slug if (methods / slug).is_dir() else _test_file(slug)
    strays = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        if path == home or home in path.parents:
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in getattr(node, "names", [])] \
                if isinstance(node, ast.Import) else []
            if any(n == f"lowrank_lit.methods.{slug}" or n.startswith(f"lowrank_lit.methods.{slug}.") for n in names):
                strays.append(path.relative_to(ROOT).as_posix())
    assert not strays, f"{slug}: tests outside {home.relative_to(ROOT)}: {strays}"


@pytest.mark.e2e
def test_summarize_cli_errors_name_the_choices(capsys):
    from lowrank_lit.cli import main

    assert main(["summarize", "nosuch", "runs"]) == 2
    err = capsys.readouterr().err
    assert "'nosuch' is not a registered method" in err and "q3r" in err and "strank" in err


# ----------------------------------------------------------------------------------------- kinds
#: kind -> the base class every component of that kind has
KIND_BASES = {
    "LightningModule": "lightning.pytorch.LightningModule",
    "Analysis": "lightning.pytorch.LightningModule",
    "Callback": "lightning.pytorch.Callback",
    "Optimizer": "torch.optim.Optimizer",
    "Loss": "torch.nn.Module",
    "Layer": "torch.nn.Module",
    "TTAMethod": "lowrank_lit.tta.base.TTAMethod",
}


def _load(path: str):
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_kinds_have_a_base():
    assert set(KIND_BASES) == set(registry.KINDS)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_kind_says_what_the_class_is(method):
    cls = _load(method.target)
    assert issubclass(cls, _load(KIND_BASES[method.kind])), f"{method.target} is registered as {method.kind}"
    if method.kind == "LightningModule":  # a module that trains something (Analysis: evaluates only)
        assert cls.training_step is not _load("lightning.pytorch.LightningModule").training_step, method.target


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


#: how the behaviour checks build a small instance of each non-module component
EXAMPLES = {
    "q3r": {"targets": ["*"]}, "glvq": {"targets": ["*"]}, "lope": {},
    "nanoadam": {"density": 0.25, "mask_interval": 1}, "is_lowrank": {"rank": 2, "update_proj_gap": 1},
    "strank": {}, "capt": {"num_layers": 2, "hidden": 8}, "pt_moe": {"hidden": 8, "prompt_len": 4, "rank": 2},
}


def _by_kind(kind):
    return [m for m in METHODS if m.kind == kind]


@pytest.mark.parametrize("method", _by_kind("Optimizer"), ids=lambda m: m.slug)
def test_optimizer_steps_and_round_trips_its_state(method):
    """Two optimizers, one restored from the other's state_dict after a step, take the same next step."""
    import copy

    import torch

    cls = _load(method.target)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 6))
    grads = [torch.randn(8, 6) for _ in range(3)]
    opt = cls([w], **EXAMPLES[method.slug])
    w.grad = grads[0]
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(before, w.detach())
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = cls([w2], **EXAMPLES[method.slug])
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as through a file (torch would alias the tensors)
    for g in grads[1:]:
        w.grad, w2.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
        assert torch.equal(w.detach(), w2.detach())


@pytest.mark.parametrize("method", _by_kind("Callback"), ids=lambda m: m.slug)
def test_callback_round_trips_its_state(method):
    cls = _load(method.target)
    a = cls(**EXAMPLES[method.slug])
    state = a.state_dict()
    b = cls(**EXAMPLES[method.slug])
    b.load_state_dict(state)
    assert _equal(b.state_dict(), state)


@pytest.mark.parametrize("method", _by_kind("Loss"), ids=lambda m: m.slug)
def test_loss_is_a_differentiable_scalar(method):
    import torch

    torch.manual_seed(0)
    pred = torch.randn(12, 5, requires_grad=True)
    counts = torch.randint(0, 20, (12, 5)).float()
    loss = _load(method.target)(**EXAMPLES[method.slug])(pred, counts)
    assert loss.ndim == 0
    loss.backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all() and pred.grad.abs().sum() > 0


@pytest.mark.parametrize("method", _by_kind("Layer"), ids=lambda m: m.slug)
def test_layer_has_prefixed_trainable_parameters_that_round_trip(method):
    """Adapter-only saving and freezing is one filter: a layer's parameters carry the ``prompt_``/``lora_`` prefix."""
    import torch

    cls = _load(method.target)
    torch.manual_seed(0)
    a = cls(**EXAMPLES[method.slug])
    names = [n for n, p in a.named_parameters() if p.requires_grad]
    assert names and all(any(part.startswith(("prompt_", "lora_")) for part in n.split(".")) for n in names), names
    torch.manual_seed(1)
    b = cls(**EXAMPLES[method.slug])
    b.load_state_dict(a.state_dict())
    assert _equal(dict(b.state_dict()), dict(a.state_dict()))


def _tta_example(slug):
    import torch

    from lowrank_lit.models.cnn import GroupNormCNN
    from lowrank_lit.models.vmamba import TinyVMamba
    from lowrank_lit.tta.base import Tent

    torch.manual_seed(0)
    if slug == "trust":
        return _load("lowrank_lit.methods.trust.TRUST")(k=2, lr=1e-2), TinyVMamba(dim=8, d_state=2), (4, 1, 8, 8)
    method = _load("lowrank_lit.methods.reservoir_tta.ReservoirTTA")(Tent(lr=1e-2), ["blocks.0.0", "blocks.1.0"],
                                                                     n_source_styles=8)
    return method, GroupNormCNN(widths=[8, 8], groups=2), (16, 1, 8, 8)


@pytest.mark.parametrize("method", _by_kind("TTAMethod"), ids=lambda m: m.slug)
def test_tta_method_returns_to_its_source_state(method):
    """After adapting, ``set_state`` of the state taken at setup gives the source parameters back exactly, and so does
    ``reset`` (per-domain episodes) where the method allows it; a method that adapts continually refuses it by name."""
    import torch

    tta, model, shape = _tta_example(method.slug)
    g = torch.Generator().manual_seed(0)
    source = [(torch.rand(shape, generator=g), torch.zeros(shape[0], dtype=torch.long)) for _ in range(10)]
    tta.setup(model, iter(source))
    initial = tta.get_state()
    start = [p.detach().clone() for p in tta.get_params()]

    def adapt():
        for _ in range(2):
            tta.forward_and_adapt(torch.rand(shape, generator=g) + 0.5)
        assert any(not torch.equal(a, b) for a, b in zip(start, tta.get_params(), strict=True)), "adaptation changed nothing"

    adapt()
    tta.set_state(initial)
    assert all(torch.equal(a, b) for a, b in zip(start, tta.get_params(), strict=True))
    try:
        tta.snapshot_source()
        adapt()
        tta.reset()
    except NotImplementedError as exc:
        assert type(tta).__name__ in str(exc)
        return
    assert all(torch.equal(a, b) for a, b in zip(start, tta.get_params(), strict=True))


@pytest.mark.parametrize("method", [m for m in METHODS if m.summary], ids=lambda m: m.slug)
def test_registered_summary_resolves(method):
    """The summary a registration names is a function of the method's own module taking (roots, out, ...)."""
    import inspect

    from lowrank_lit.launch.summarize import get_summary

    summary = get_summary(method.slug)
    assert summary.fn.__module__ == method.target.rpartition(".")[0]
    assert list(inspect.signature(summary.fn).parameters)[1] == "out"  # (run roots, out, options...)
    assert summary.help and not summary.help.endswith(",")


def test_every_paper_method_has_a_summary():
    assert [m.slug for m in METHODS if m.summary is None] == ["baseline", "pinv_bounds"]
