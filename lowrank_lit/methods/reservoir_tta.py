"""ReservoirTTA: a reservoir of domain-specialised models for prolonged test-time adaptation.

Vray, Tomar, Gao, Thiran, Shelhamer, Bozorgtabar, NeurIPS 2025 (arXiv 2505.14511). Official code:
github.com/LTS5/ReservoirTTA.

A plug-in around any single-model TTA method (:mod:`lowrank_lit.tta`): every test batch gets a style
vector (log-variance of frozen convolutional features); batches are clustered online against
learnable centroids; each cluster (domain) owns a copy of the adapted parameters and optimizer state;
only the copy a batch is routed to adapts; predictions use the probability-weighted average of all
copies. A recurring domain returns to its specialist, so nothing is forgotten or re-learned.

Per batch (method card 11, section 2):

* style ``s = concat_l log(Var_{b,h,w} F_l(x) + 1e-5)`` (unbiased, per channel; the eps is inferred);
* threshold ``tau`` = the ``quantile`` (0.999) of pairwise L2 distances of ``n_source_styles`` styles of
  random clean source batches (same batch size as the stream);
* centroids ``c_k = mean source style + delta_k`` (``delta`` learnable, AdamW ``centroid_lr``); K = 1
  at the start (the source model);
* new domain if the batch is full-size, ``min_k ||s - c_k|| > tau`` and ``K < max_models``: a centroid
  at ``s``; the new copy starts from the copy j* minimising ``mean H(p_j(x)) + sum_c pbar_jc log pbar_jc``
  (maximal mutual information on this batch; ``init="mi"``) or from the source (``init="source"``);
* logits ``a_ik = -||row_i - c_k||`` over the rows = style buffer + {s}; one AdamW step on
  ``mean_i H(softmax(a_i)) + sum_k qbar_k log qbar_k``; routing ``q = softmax(a_s)``, ``k* = argmax q``
  (from the logits before that step);
* prediction with ``theta_ens = sum_k q_k theta_k`` (or ``theta_k*`` with ``ensembling=False``), then the
  base method's step on copy k* (``progressive_update``: ``theta_k* <- (1-q_k*) theta_k* + q_k* theta``);
* style buffer of capacity ``(buffer_size // max_models) * K``: reservoir sampling (``reservoir``),
  newest-kept (``fifo``) or random replacement (``replace``); the reservoir counter is reset to the
  capacity when it exceeds 10 x capacity.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.registry import register_method
from lowrank_lit.report import Run, class_label, markdown_table, read_runs
from lowrank_lit.tta.base import TTAMethod, TTAWrapper, entropy

__all__ = ["StyleExtractor", "ReservoirTTA"]

PAPER = "ReservoirTTA: Prolonged Test-time Adaptation for Evolving and Recurring Domains"
SAMPLINGS = ("reservoir", "fifo", "replace")
INITS = ("mi", "source")
FORMATS = ("logvar", "var", "meanvar")


class _StopForward(Exception):
    """Raised by the last style hook to end the extractor's forward pass early."""


class StyleExtractor(nn.Module):
    """Style vector of a batch from the outputs of named layers of a frozen network.

    Args:
        backbone: the (frozen) network; a deep copy of the source model in ReservoirTTA.
        layers: names of the modules whose outputs ``(B, C, H, W)`` give the statistics.
        fmt: ``logvar`` (log of the per-channel variance, default), ``var``, or ``meanvar`` (mean and log variance).
        eps: added inside the log. Default: 1e-5.
        channels_last: run the frozen backbone on 4-D inputs in channels-last memory format (same values up
            to float rounding; on CPU several times faster for few-channel convolutions and max-pooling).
            Default: True.
    """

    def __init__(self, backbone: nn.Module, layers: list[str], fmt: str = "logvar", eps: float = 1e-5,
                 channels_last: bool = True) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"StyleExtractor: fmt={fmt!r}; allowed: {', '.join(FORMATS)}")
        modules = dict(backbone.named_modules())
        missing = [n for n in layers if n not in modules]
        if missing or not layers:
            raise ValueError(f"StyleExtractor: layers {missing or layers} not found; some available: {list(modules)[1:12]}")
        self.backbone = backbone.eval().requires_grad_(False)
        self.channels_last = channels_last
        if channels_last:
            self.backbone.to(memory_format=torch.channels_last)  # only 4-D parameters change layout
        self.layers, self.fmt, self.eps = list(layers), fmt, eps
        self._out: dict[str, torch.Tensor] = {}
        for name in self.layers:
            modules[name].register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def fn(module: nn.Module, inp: Any, out: torch.Tensor) -> None:
            self._out[name] = out
            if len(self._out) == len(self.layers):
                raise _StopForward  # every statistic is in: skip the rest of the network

        return fn

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._out.clear()
        if self.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        try:
            self.backbone(x)
        except _StopForward:
            pass
        parts = []
        for name in self.layers:
            f = self._out[name]  # (B, C, H, W)
            # (C,) unbiased variance over batch and space; two passes (mean, then centred squares) are
            # as stable as Tensor.var and several times faster on CPU for (B, C, H, W) reductions
            mean = f.mean(dim=(0, 2, 3), keepdim=True)  # (1, C, 1, 1)
            var = (f - mean).pow(2).sum(dim=(0, 2, 3)) / (f.numel() // f.shape[1] - 1)
            if self.fmt == "var":
                parts.append(var)
            else:
                lv = torch.log(var + self.eps)
                parts.append(lv if self.fmt == "logvar" else torch.cat([mean.flatten(), lv]))
            if not bool(torch.isfinite(parts[-1]).all()):
                raise RuntimeError(f"StyleExtractor: non-finite style statistics at layer {name!r}")
        return torch.cat(parts)  # (sum of channels,)


@register_method("reservoir_tta", kind="TTAMethod", paper=PAPER, summary="summary", bench="bench")
class ReservoirTTA(TTAWrapper):
    """A reservoir of copies of ``method``'s adapted state, one per discovered domain (see module docstring).

    Args:
        method: the base single-model TTA method (Tent, EATA, ...).
        style_layers: module names of the frozen source copy whose outputs give the style.
        max_models: most domains / copies K_max. Default: 16.
        buffer_size: style-buffer size at K_max (capacity (buffer_size // max_models) x K). Default: 64.
        quantile: quantile of source style distances used as the new-domain threshold. Default: 0.999.
        ensembling: predict with the q-weighted parameter average (else the routed copy). Default: True.
        sampling: style-buffer policy ``reservoir``, ``fifo`` or ``replace``. Default: reservoir.
        init: new copies start from the max-mutual-information copy (``mi``) or the source. Default: mi.
        progressive_update: blend the adapted copy with weight q_k*. Default: False.
        centroid_lr: AdamW lr of the centroid offsets. Default: 1e-4.
        n_source_styles: clean source batches for the threshold. Default: 1000.
        fmt: style format of :class:`StyleExtractor`. Default: logvar.
        seed: seed of the buffer sampling. Default: 0.
    """

    def __init__(
        self,
        method: TTAMethod,
        style_layers: list[str],
        max_models: int = 16,
        buffer_size: int = 64,
        quantile: float = 0.999,
        ensembling: bool = True,
        sampling: str = "reservoir",
        init: str = "mi",
        progressive_update: bool = False,
        centroid_lr: LearningRate = 1e-4,
        n_source_styles: int = 1000,
        fmt: str = "logvar",
        seed: int = 0,
    ) -> None:
        super().__init__(method)  # the wrapped method's network, parameters and optimizer are ours
        where = "ReservoirTTA"
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"{where}: quantile={quantile!r}; allowed: (0, 1)")
        if max_models < 1:
            raise ValueError(f"{where}: max_models={max_models!r}; allowed: an integer >= 1")
        if buffer_size < max_models:
            raise ValueError(f"{where}: buffer_size={buffer_size!r} < max_models={max_models}; allowed: buffer_size >= max_models")
        if centroid_lr <= 0:
            raise ValueError(f"{where}: centroid_lr={centroid_lr!r}; allowed: > 0")
        if sampling not in SAMPLINGS:
            raise ValueError(f"{where}: sampling={sampling!r}; allowed: {', '.join(SAMPLINGS)}")
        if init not in INITS:
            raise ValueError(f"{where}: init={init!r}; allowed: {', '.join(INITS)}")
        if fmt not in FORMATS:
            raise ValueError(f"{where}: fmt={fmt!r}; allowed: {', '.join(FORMATS)}")
        if n_source_styles < 2:
            raise ValueError(f"{where}: n_source_styles={n_source_styles!r}; allowed: an integer >= 2")
        self.style_layers = list(style_layers)
        self.max_models, self.buffer_size, self.quantile = max_models, buffer_size, quantile
        self.ensembling, self.sampling, self.init, self.progressive_update = ensembling, sampling, init, progressive_update
        self.centroid_lr, self.n_source_styles, self.fmt = centroid_lr, n_source_styles, fmt
        self.generator = torch.Generator().manual_seed(seed)
        self.last_cluster: int | None = None
        #: set to ``{}`` to record the wall time of each phase of every batch (``phase -> [seconds per batch]``):
        #: style, routing, predict (the ensembled model), adapt, states (copies kept); ``lowrank bench`` reads it
        self.phase_seconds: dict[str, list[float]] | None = None

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        if self.phase_seconds is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds.setdefault(name, []).append(time.perf_counter() - start)

    # -- setup -------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, source_batches: Iterable[Any] | None = None) -> None:
        if source_batches is None:
            raise ValueError("ReservoirTTA: needs clean source batches (a datamodule with source_dataloader())")
        self.extractor = StyleExtractor(copy.deepcopy(model), self.style_layers, self.fmt)
        batches = iter(source_batches)
        self.method.setup(model, batches)
        styles, sizes = [], []
        for _ in range(self.n_source_styles):
            x = next(batches)[0]
            styles.append(self.extractor(x))
            sizes.append(len(x))
        self.set_source_styles(torch.stack(styles), max(sizes))
        self.copies = [self.method.get_state()]
        self.source_state = self.method.get_state()

    def set_source_styles(self, styles: torch.Tensor, batch_size: int) -> None:
        """Source style statistics ``(n, D)``: the mean (centroid origin) and the distance threshold tau."""
        self.source_mean = styles.mean(dim=0)
        d = torch.cdist(styles, styles)
        iu = torch.triu_indices(len(styles), len(styles), offset=1)
        self.tau = float(torch.quantile(d[iu[0], iu[1]], self.quantile))
        self.batch_size = batch_size
        self.deltas = nn.ParameterList([nn.Parameter(torch.zeros_like(self.source_mean))])
        self.centroid_opt = torch.optim.AdamW(self.deltas.parameters(), lr=self.centroid_lr)
        self.buffer: list[torch.Tensor] = []
        self.seen = 0

    @property
    def num_models(self) -> int:
        return len(self.deltas)

    def centroids(self) -> torch.Tensor:
        return torch.stack([self.source_mean + d for d in self.deltas])  # (K, D)

    # -- pieces ------------------------------------------------------------------------------------
    def capacity(self) -> int:
        return (self.buffer_size // self.max_models) * self.num_models

    def _buffer_add(self, s: torch.Tensor) -> None:
        cap = self.capacity()
        self.seen += 1
        if self.seen > 10 * cap:
            self.seen = cap
        if len(self.buffer) < cap:
            self.buffer.append(s)
        elif self.sampling == "fifo":
            self.buffer = self.buffer[len(self.buffer) - cap + 1 :] + [s]
        elif self.sampling == "replace":
            self.buffer[int(torch.randint(len(self.buffer), (1,), generator=self.generator))] = s
        else:  # reservoir
            j = int(torch.randint(self.seen, (1,), generator=self.generator))
            if j < cap:
                self.buffer[j] = s

    def mutual_information_scores(self, x: torch.Tensor) -> list[float]:
        """``mean H(p_j(x)) + sum_c pbar_jc log pbar_jc`` for every copy j (lower = more informative)."""
        current = self.method.get_state()
        scores = []
        for state in self.copies:
            self.method.set_state(state)
            logits = self.method.predict(x)
            p = logits.softmax(dim=1)
            pbar = p.mean(dim=0)
            scores.append(float(entropy(logits).mean() + (pbar * torch.log(pbar + 1e-12)).sum()))
        self.method.set_state(current)
        return scores

    def _new_domain(self, s: torch.Tensor, x: torch.Tensor) -> None:
        if self.init == "mi":
            start = self.copies[min(range(len(self.copies)), key=self.mutual_information_scores(x).__getitem__)]
        else:
            start = self.source_state
        delta = nn.Parameter((s - self.source_mean).detach().clone())
        self.deltas.append(delta)
        self.centroid_opt.add_param_group({"params": [delta]})
        self.copies.append(copy.deepcopy(start))

    def route(self, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Update the clusters with style ``s`` of batch ``x``; returns the routing probabilities q (K,)."""
        dist = torch.linalg.vector_norm(self.centroids().detach() - s, dim=1)
        if len(x) >= self.batch_size and float(dist.min()) > self.tau and self.num_models < self.max_models:
            self._new_domain(s, x)
        rows = torch.stack([*self.buffer, s])  # (N, D)
        with torch.enable_grad():
            a = -torch.cdist(rows, self.centroids())  # (N, K)
            q_rows = a.softmax(dim=1)
            qbar = q_rows.mean(dim=0)
            loss = -(q_rows * a.log_softmax(dim=1)).sum(dim=1).mean() + (qbar * torch.log(qbar + 1e-12)).sum()
            self.centroid_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.centroid_opt.step()
        q = a[-1].detach().softmax(dim=0)
        self._buffer_add(s)
        return q

    def ensemble(self, q: torch.Tensor) -> list[torch.Tensor]:
        """``theta_ens = sum_k q_k theta_k``."""
        weights = q.tolist()  # one conversion, not one per (copy, parameter)
        return [sum(w * copy_["params"][i] for w, copy_ in zip(weights, self.copies, strict=True))
                for i in range(len(self.params))]

    # -- one batch ---------------------------------------------------------------------------------
    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        with self._phase("style"):
            s = self.extractor(x)
        with self._phase("routing"):
            q = self.route(s, x)
        k = int(q.argmax())
        self.last_cluster, self.last_q = k, q
        if self.ensembling:
            # the prediction needs the ensembled parameters and the routed copy's method buffers (e.g.
            # CoTTA's teacher), not its optimizer state: that is loaded for adapting only
            with self._phase("predict"):
                self.method.load_extra_state(copy.deepcopy(self.copies[k]["extra"]))
                self.method.load_params(self.ensemble(q))
                logits = self.method.predict(x)
            with self._phase("adapt"):
                self.method.set_state(self.copies[k], copy_state=False)  # copy k is replaced by the new state below
                self.method.adapt(x)
        else:
            # the routed copy predicts: its pre-step logits come out of the adaptation forward pass itself
            with self._phase("adapt"):
                self.method.set_state(self.copies[k], copy_state=False)
                logits = self.method.forward_and_adapt(x)
        with self._phase("states"):
            new = self.method.get_state()
            if self.progressive_update:
                w = float(q[k])
                new["params"] = [(1 - w) * old + w * p
                                 for old, p in zip(self.copies[k]["params"], new["params"], strict=True)]
            self.copies[k] = new
        return logits

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.predict(x)

    def stream_state(self) -> dict[str, Any]:
        """The reservoir: every copy's adapted state, the centroids (offsets and their optimizer), the style buffer
        and its counters, the threshold and the sampling generator; the method's current state."""
        return {"state": self.method.get_state(), "copies": self.copies, "source_state": self.source_state,
                "source_mean": self.source_mean, "tau": self.tau, "batch_size": self.batch_size,
                "deltas": [d.detach() for d in self.deltas], "centroid_opt": self.centroid_opt.state_dict(),
                "buffer": list(self.buffer), "seen": self.seen, "generator": self.generator.get_state()}

    def load_stream_state(self, state: dict[str, Any]) -> None:
        self.method.set_state(state["state"])
        self.copies = [copy.deepcopy(c) for c in state["copies"]]
        self.source_state = copy.deepcopy(state["source_state"])
        self.source_mean, self.tau, self.batch_size = state["source_mean"].clone(), state["tau"], state["batch_size"]
        self.deltas = nn.ParameterList([nn.Parameter(d.clone()) for d in state["deltas"]])
        self.centroid_opt = torch.optim.AdamW([{"params": [d]} for d in self.deltas], lr=self.centroid_lr)
        self.centroid_opt.load_state_dict(state["centroid_opt"])
        self.buffer, self.seen = [b.clone() for b in state["buffer"]], state["seen"]
        self.generator.set_state(state["generator"])



def _method_label(cfg_method: dict[str, Any]) -> str:
    name = class_label(cfg_method)
    if name == "ReservoirTTA":
        return _method_label(cfg_method["init_args"]["method"]) + " + Reservoir"
    return name


def summarize(run_dirs: list[str]) -> list[dict[str, Any]]:
    """Method label, error per recurrence, model count and purity of each TTA run directory."""

    from lowrank_lit.metrics import purity

    out = []
    for run in map(Run, run_dirs):
        cfg = run.config
        rows = run.rows("tta_batches.csv")
        per: dict[int, list[float]] = {}
        for r in rows:
            per.setdefault(int(r["recurrence"]), []).append(float(r["error"]))
        row: dict[str, Any] = {"method": _method_label(cfg["model"]["init_args"]["method"]),
                               "per_recurrence": {k: sum(v) / len(v) for k, v in sorted(per.items())}}
        if rows and rows[0].get("cluster") not in (None, ""):
            clusters = [int(r["cluster"]) for r in rows]
            row["models"] = max(clusters) + 1
            row["purity"] = purity(clusters, [int(r["domain"]) for r in rows])
        out.append(row)
    return out


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: error (%) per recurrence per method, with the model count and purity of reservoir runs."""
    recs = sorted({k for r in rows for k in r["per_recurrence"]})
    table = []
    for r in rows:
        errs = [f"{100 * r['per_recurrence'][k]:.1f}" if k in r["per_recurrence"] else "-" for k in recs]
        extra = [r["models"], f"{r['purity']:.3f}"] if "models" in r else ["-", "-"]
        table.append([r["method"], *errs, *extra])
    return markdown_table(["method", *(f"r{k + 1}" for k in recs), "models", "purity"], table)


def summary(roots: list[str], out: str | None = None) -> str:
    """Error per recurrence of test-time adaptation runs (and a plot, one line per run)."""
    from lowrank_lit.tta.module import plot_recurrence

    dirs = read_runs(roots, "tta_batches.csv")
    rows = summarize(dirs)
    if out:
        plot_recurrence({r["method"]: r["per_recurrence"] for r in rows}, out)
    return summary_table(rows)


def bench(ctx: Any) -> list[Any]:
    """Time per test batch of Tent + ReservoirTTA against plain Tent on the digits CSC stream (random source
    weights) (``lowrank bench reservoir_tta``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("reservoir_tta", "Tent + ReservoirTTA per test batch", "Tent per batch",
                        "configs/reservoir_tta/csc_digits.yaml", "configs/reservoir_tta/csc_digits_tent.yaml",
                        "our target <= 1.5x (routing + ensembling)", 1.5,
                        overrides=("--model.init_args.source_ckpt=null",), verb="test", steps=24, quick_steps=6,
                        rounds=3, phases="method.phase_seconds")]
