"""``TTAModule``: online test-time adaptation inside ``lowrank test``.

The module wraps a source-trained network (its weights come from the checkpoint of an earlier
``lowrank fit`` run) and a TTA method given by ``class_path`` (``SourceOnly``, ``Tent``, ``EATA``,
``CoTTA`` or a plug-in such as ``ReservoirTTA`` around one of them). Every test batch is predicted
and then adapted on, in stream order. Batches are ``(x, y, domain, recurrence)`` as produced by
:class:`lowrank_lit.data.corruptions.DigitsCorruptionDataModule`.

Logged: ``test/error`` (the stream's error, weighted by batch size; shown while it runs), and at the end
``test/error_last`` (the last recurrence), per-recurrence ``test/error_r<k>``, the accuracy per domain ``test/acc_<corruption>`` and their
mean ``test/acc_domains``, and, for a plug-in that routes batches to clusters,
``test/clusters`` (clusters that received batches), ``test/models`` (copies held, the source's included)
and ``test/purity``. Written to the run directory: ``tta_batches.csv`` (one row per batch: error,
mean prediction entropy, cluster), ``tta_recurrence.csv`` (error per recurrence), ``tta_recurrence.png`` and
the method's own tables (:meth:`TTAMethod.tables`, e.g. TRUST's traversal ranking).

With ``reset_each_domain`` the method returns to the source weights and a fresh optimizer whenever the
domain index of the stream changes (:meth:`TTAMethod.reset`).

The trainer must run with ``inference_mode: false`` (adaptation needs gradients in ``test``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import nn

from lowrank_lit.checkpoint import load_checkpoint
from lowrank_lit.data.stream import label_entropy
from lowrank_lit.metrics import purity
from lowrank_lit.report import artifact_path, log_image, may_write, new_figure, save_figure, save_rows
from lowrank_lit.tta.base import SourceData, TTAMethod

__all__ = ["TTAModule", "load_backbone", "purity"]


def load_backbone(model: nn.Module, ckpt_path: str, prefix: str = "backbone.") -> None:
    """Load the ``prefix``-ed weights of a Lightning checkpoint (e.g. an ``ImageClassifier``'s) into ``model``."""
    if not os.path.isfile(ckpt_path):
        hint = ("; {seed} is filled by lowrank fit/test, in Python give the path itself" if "{" in ckpt_path
                else " (train the source model first)")
        raise FileNotFoundError(f"TTAModule: source_ckpt={ckpt_path!r} does not exist{hint}")
    state = load_checkpoint(ckpt_path, "TTAModule: source_ckpt")
    state = state.get("state_dict", state)
    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)} or state
    try:
        model.load_state_dict(sub)
    except RuntimeError as err:
        raise ValueError(f"TTAModule: source_ckpt={ckpt_path!r} does not fit the model: {str(err).splitlines()[0]}") from None


class TTAModule(pl.LightningModule):
    """Online test-time adaptation of a source model; see the module docstring.

    Args:
        model: the network (same architecture as the source run's backbone).
        method: the TTA method (``lowrank_lit.tta.Tent``, ``...EATA``, ``...CoTTA``, ``...SourceOnly``,
            ``lowrank_lit.methods.reservoir_tta.ReservoirTTA``).
        source_ckpt: checkpoint of the source training run (under ``lowrank``, ``{seed}`` in the path is the run
            seed, for sweeps over seeds: :func:`lowrank_lit.launch.checks.resolve_path_templates`); None keeps the
            model's weights (tests). Default: None.
        source_batches: clean source batches given to the method at setup (EATA's Fisher, ReservoirTTA's
            source styles come from the datamodule's ``source_dataloader``). Default: True.
        reset_each_domain: return to the source weights and a fresh optimizer whenever the stream's domain
            changes (online but episodic per domain, TRUST's protocol). Default: False (continual).
        stream_state: a ``stream_state/`` folder an earlier run wrote: the method starts from the adapted
            state(s) saved there (a reservoir with its copies and centroids, TRUST's traversal order) instead of
            the source model's, so a stream can be continued or an adapted model evaluated on other data. The
            source model must be the same (checked by digest). Default: None.
        plugin: a plug-in that wraps ``method`` (e.g. ``lowrank_lit.methods.reservoir_tta.ReservoirTTA`` given
            without its ``method``), so that a config fragment adds it to any method. Default: None.

    At the end of the stream the run directory gets ``stream_state/`` (``state.safetensors`` + ``state.json``:
    :meth:`TTAMethod.stream_state` and the source model's digest).
    """

    sharding_refusal: ClassVar[str | None] = "it adapts at test time, batch by batch on one stream (lowrank test); nothing trains to shard"

    def __init__(self, model: nn.Module, method: TTAMethod, source_ckpt: str | None = None, source_batches: bool = True,
                 reset_each_domain: bool = False, stream_state: str | None = None,
                 plugin: Callable[[TTAMethod], TTAMethod] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "method", "plugin"], logger=False)
        self.model = model
        self.method = plugin(method) if plugin is not None else method
        self.automatic_optimization = False
        self.source_ckpt = source_ckpt
        self.use_source_batches = source_batches
        self.reset_each_domain = reset_each_domain
        self.stream_state = stream_state
        self._source_digest: str | None = None
        self._domain: int | None = None
        self.rows: list[dict[str, Any]] = []
        self._ready = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def _prepare(self) -> None:
        if self._ready:
            return
        if self.source_ckpt is not None:
            load_backbone(self.model, self.source_ckpt)
        batches = None
        dm = self.trainer.datamodule if self._trainer is not None else None
        if self.use_source_batches and isinstance(dm, SourceData):
            gen = torch.Generator().manual_seed(int(torch.initial_seed()) % 2**63)
            batches = _cycle(lambda: dm.source_dataloader(generator=gen))
        from lowrank_lit.artifacts import state_digest

        self._source_digest = state_digest(self.model.state_dict())
        self.method.setup(self.model, batches)
        if self.reset_each_domain:
            self.method.snapshot_source()
        if self.stream_state is not None:
            self._resume(self.stream_state)
        self._ready = True

    def _resume(self, folder: str) -> None:
        from lowrank_lit.artifacts import ArtifactError, load_state

        state, meta = load_state(folder)
        if meta.get("method") != type(self.method).__name__:
            raise ArtifactError(f"stream_state={folder!r} was saved by {meta.get('method')}, not "
                                f"{type(self.method).__name__}")
        if meta.get("source_digest") != self._source_digest:
            raise ArtifactError(f"stream_state={folder!r} was adapted from another source model (digest "
                                f"{meta.get('source_digest')} vs {self._source_digest})")
        self.method.load_stream_state(state)

    def on_test_start(self) -> None:
        if torch.is_inference_mode_enabled():
            raise RuntimeError("TTAModule adapts during `test`: run the trainer with inference_mode=false "
                               "(config: `trainer: {inference_mode: false}`)")
        self._prepare()
        self.rows = []
        self._per_domain: dict[int, list[float]] = {}  # domain -> [wrong predictions, samples], stream order
        self._domain = None

    def test_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        x, y = batch[0], batch[1]
        domain = int(batch[2][0]) if len(batch) > 2 else 0
        rec = int(batch[3][0]) if len(batch) > 3 else 0
        if self.reset_each_domain and self._domain is not None and domain != self._domain:
            self.method.reset()
        self._domain = domain
        self.method.domain = domain
        logits = self.method.forward_and_adapt(x)
        wrong = (logits.argmax(dim=1) != y).float()  # (B,)
        err = float(wrong.mean())
        entropy = float(-(logits.softmax(dim=1) * logits.log_softmax(dim=1)).sum(dim=1).mean())  # Tent's objective
        doms = batch[2] if len(batch) > 2 else torch.zeros(len(x), dtype=torch.long)
        present = torch.unique(doms).tolist()
        for d in present:  # per-sample accounting: a mixed batch holds several domains
            sel = doms == d
            acc = self._per_domain.setdefault(int(d), [0.0, 0])
            acc[0] += float(wrong[sel].sum())
            acc[1] += int(sel.sum())
        row = {"batch": batch_idx, "domain": domain, "recurrence": rec, "n": len(x), "error": err, "entropy": entropy,
               "label_entropy": label_entropy(y, logits.shape[1]), "domains": len(present)}
        cluster = self.method.last_cluster
        if cluster is not None:
            row["cluster"] = cluster
        self.rows.append(row)
        self.log("test/error", err, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(x))

    def _domain_names(self) -> dict[int, str]:
        dm = self.trainer.datamodule if self._trainer is not None else None
        return dict(enumerate(getattr(dm, "corruptions", None) or []))

    def on_test_epoch_end(self) -> None:
        if not self.rows:
            return
        recs = sorted({r["recurrence"] for r in self.rows})
        per_rec = {k: sum(r["error"] for r in self.rows if r["recurrence"] == k) / sum(1 for r in self.rows if r["recurrence"] == k) for k in recs}
        for k, v in per_rec.items():
            self.log(f"test/error_r{k}", v)
        self.log("test/error_last", per_rec[recs[-1]])
        names = self._domain_names()
        label = {d: names.get(d, f"d{d}") for d in self._per_domain}
        errors = {d: w / n for d, (w, n) in self._per_domain.items()}  # per-sample error of each domain
        # the stream's own statistics: how mixed its batches' labels are, how often its domain changes
        self.log("test/label_entropy", sum(r["label_entropy"] for r in self.rows) / len(self.rows))
        self.log("test/domain_switches", float(sum(a["domain"] != b["domain"] for a, b in zip(self.rows, self.rows[1:], strict=False))))
        self.log("test/domains_per_batch", sum(r["domains"] for r in self.rows) / len(self.rows))
        from lowrank_lit.bench import tensor_bytes

        # what the method holds besides the network: adapted copies, optimizer moments, teachers, memory banks
        stream_state = self.method.stream_state()
        self.log("test/state_mb", tensor_bytes(stream_state) / 2**20)
        accs = []
        for d in sorted(self._per_domain):
            acc = 1.0 - errors[d]
            self.log(f"test/acc_{label[d]}", acc)
            accs.append(acc)
        self.log("test/acc_domains", sum(accs) / len(accs))  # mean over domains of the per-domain accuracy
        if "cluster" in self.rows[0]:
            clusters = [r["cluster"] for r in self.rows]
            self.log("test/clusters", float(len(set(clusters))))  # clusters that received batches
            self.log("test/models", float(self.method.num_models))  # reservoir size, source copy included
            self.log("test/purity", purity(clusters, [r["domain"] for r in self.rows]))
        self.per_recurrence = per_rec
        if may_write(self.trainer):
            self._save(per_rec, {label[d]: e for d, e in errors.items()})
            from lowrank_lit.artifacts import save_state

            save_state(artifact_path(self.trainer, "stream_state"), stream_state,
                       {"method": type(self.method).__name__, "source_digest": self._source_digest,
                        "batches": len(self.rows)})

    def _save(self, per_rec: dict[int, float], per_domain: dict[str, float]) -> None:
        save_rows(self.trainer, self.rows, "tta_batches.csv")
        save_rows(self.trainer, [{"recurrence": k, "error": v} for k, v in per_rec.items()], "tta_recurrence.csv")
        for name, rows in self.method.tables().items():
            save_rows(self.trainer, rows, name)
        path = plot_recurrence({type(self.method).__name__: per_rec}, artifact_path(self.trainer, "tta_recurrence.png"),
                               per_domain={type(self.method).__name__: per_domain})
        log_image(self.trainer, "tta/recurrence", path)


def _cycle(make: Any) -> Any:
    """Endless batches from a loader factory (re-created when exhausted)."""
    while True:
        yield from make()


def plot_recurrence(curves: dict[str, dict[int, float]], out: str,
                    per_domain: dict[str, dict[str, float]] | None = None) -> str:
    """Error per recurrence, one line per method; a stream of one recurrence (a single point per method) is drawn
    as the error per corruption in stream order instead, when ``per_domain`` (method -> corruption -> error) is
    given."""
    fig, ax = new_figure(figsize=(6.5, 4))
    if per_domain and all(len(per) < 2 for per in curves.values()):
        for name, errs in per_domain.items():
            ax.plot(range(len(errs)), [100 * e for e in errs.values()], marker="o", label=name)
            ax.set_xticks(range(len(errs)), list(errs), rotation=30, ha="right", fontsize=7)
        ax.set_xlabel("corruption (stream order)")
        ax.set_title("Test-time adaptation: error per corruption (one pass)", fontsize=10)
    else:
        for name, per in curves.items():
            ks = sorted(per)
            ax.plot([k + 1 for k in ks], [100 * per[k] for k in ks], marker="o", label=name)
        ax.set_xlabel("recurrence")
        ax.set_title("Test-time adaptation: error per recurrence of the stream", fontsize=10)
    ax.set_ylabel("error (%)")
    ax.legend(fontsize=8)
    return save_figure(fig, out)
