"""The table of frozen-backbone tuning runs: one row per prompt (or adapter) configuration, mean +/- std over its
runs, and a bar plot; the summaries of capt, lope and pt_moe are built from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowrank_lit.report import markdown_table, mean_std, new_figure, read_runs, save_figure

__all__ = ["prompt_label", "prompt_runs_table"]

#: Prompt arguments that tell runs apart in result tables (width, depth and init text do not).
_LABEL_KEYS = ("n_experts", "n_prompts", "prompt_len", "rank", "routing", "instance", "train_task_vector", "variant")


def prompt_label(prompt: dict[str, Any] | None) -> str:
    """``SoftPrompt(prompt_len=16)``-style label of a run's prompt config (``head only`` for None)."""
    if not prompt:
        return "head only"
    args = prompt.get("init_args") or {}
    shown = ", ".join(f"{k}={args[k]}" for k in _LABEL_KEYS if k in args)
    return f"{str(prompt['class_path']).rsplit('.', 1)[-1]}({shown})"


def prompt_runs_table(roots: list[str], columns: tuple[str, ...], out: str | None = None, title: str = "",
                      label: Callable[[dict[str, Any]], str] | None = None, first: str = "prompt",
                      params: tuple[str, ...] = ("params/prompt", "params/head"), highlight: str | None = None) -> str:
    """Markdown table of frozen-backbone tuning runs: one row per method, mean +/- std over its runs.

    Args:
        roots: run roots searched for finished runs (a ``metrics.csv`` with ``columns[0]``).
        columns: metrics to report (``test/...``); accuracies print in %, the rest with 3 decimals; missing: ``-``.
        out: also save a bar plot of the first column (mean +/- std) here.
        title: the plot's title.
        label: ``config -> row label``; default: :func:`prompt_label` of the run's prompt.
        first: header of the label column.
        params: parameter-count metrics shown after the run count.
        highlight: rows whose label starts with this (the paper's method) are drawn in their own colour and named
            in the plot's legend; the others are the baselines.
    """
    import statistics

    groups: dict[str, list[dict[str, float]]] = {}
    for run in read_runs(roots, "metrics.csv"):
        values = run.metrics
        if columns[0] not in values:
            continue  # unfinished run
        cfg = run.config
        name = label(cfg) if label is not None else prompt_label(cfg["model"]["init_args"].get("prompt"))
        groups.setdefault(name, []).append(values)
    if not groups:
        raise FileNotFoundError(f"no finished prompt-tuning run (with {columns[0]}) under {', '.join(roots)}")

    def cell(runs: list[dict[str, float]], key: str) -> str:
        xs = [r[key] for r in runs if key in r]
        if not xs:
            return "-"
        if key.startswith("params/"):
            return f"{int(xs[0]):,}"
        accuracy = key.startswith("test/acc") or key.endswith("_acc")
        return mean_std(xs, ".1f", 100.0) if accuracy else mean_std(xs, ".3f")

    header = [first, "runs", *(p.split("/", 1)[1] + " params" for p in params), *columns]
    rows = [[name, len(runs), *(cell(runs, p) for p in params), *(cell(runs, c) for c in columns)]
            for name, runs in sorted(groups.items())]
    if out:
        import textwrap

        fig, ax = new_figure(figsize=(max(6.0, 1.6 * len(groups) + 1), 4.2))
        labels = sorted(groups)
        means = [statistics.fmean(r[columns[0]] for r in groups[k]) for k in labels]
        stds = [statistics.stdev([r[columns[0]] for r in groups[k]]) if len(groups[k]) > 1 else 0.0 for k in labels]
        mine = [bool(highlight) and k.startswith(highlight) for k in labels]
        ax.bar(range(len(labels)), means, yerr=stds, capsize=3, color=["tab:red" if m else "tab:gray" for m in mine])
        # whole words per line (a label is never broken inside a word)
        ax.set_xticks(range(len(labels)), [textwrap.fill(k.replace("(", " (").replace(", ", " "), 16,
                                                         break_long_words=False, break_on_hyphens=False) for k in labels],
                      fontsize=7)
        ax.set_ylabel(columns[0])
        ax.set_ylim(max(0.0, min(means) - 0.1), 1.0)
        ax.set_title(textwrap.fill(title, 60), fontsize=10)
        if any(mine):
            from matplotlib.patches import Patch

            ax.legend(handles=[Patch(color="tab:red", label=f"{highlight} (the paper's method)"),
                               Patch(color="tab:gray", label="baselines")], fontsize=7, loc="lower right")
        save_figure(fig, out)
    return markdown_table(header, rows)
