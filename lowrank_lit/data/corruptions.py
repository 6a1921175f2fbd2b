"""A stream of corrupted test batches for test-time adaptation: recurring (CSC) or random (CDC) domains.

Corruptions act on images in [0, 1] of shape (B, C, H, W), each at a severity ``level`` (defaults in
:data:`DEFAULT_LEVELS`: the ReservoirTTA experiment's, paper 11): ``gaussian_noise`` (sigma 0.5),
``impulse_noise`` (15 % of the pixels set to 0 or 1), ``blur`` (two passes of a 5x5 binomial filter; level
= kernel size 3 or 5), ``contrast`` (x 0.25 around the image mean), ``inversion`` (1 - x), ``brightness``
(0.6 x + 0.4; level = the offset), ``shift`` (each image moved by 1 px in one of 8 directions, zeros
shifted in) and ``occluder`` (a black 4 x 4 square at a random place). TRUST's digits-C (paper 19) uses
sigma 0.35, contrast 0.3 and the 3x3 blur on 8x8 digits. Results are clipped to [0, 1] (inferred). Each
corruption draws its noise from a generator, so the stream is reproducible.

``corruption_stream`` orders (domain, batch) visits: ``csc`` = the corruptions in a fixed order,
``recurrences`` times (continual structured change); ``cdc`` = runs of random length (1 .. 2 x
batches_per_visit) of randomly chosen domains, never the same twice in a row, with the same total
number of batches (continual dynamic change). Three harder streams follow the CSC visits with the same
number of batches (:data:`STREAM_SETTINGS`): ``mixed`` = every image of a batch from a domain drawn at
random (all domains interleaved); ``correlated`` = the labels of each visit ordered by
:func:`lowrank_lit.data.stream.dirichlet_order` with concentration ``dirichlet_alpha`` (0.01: batches of
one or two classes); ``gradual`` = inside each visit the severity rises 1 -> 5 -> 1
(:func:`lowrank_lit.data.stream.severity_ramp`), severity s being the blend ``x + (s / 5) (corrupt(x) - x)``
of the clean and the fully corrupted image (our substitute for the five severity files of CIFAR-10-C;
inferred). ``DigitsCorruptionDataModule`` serves the stream
built from the held-out split of scikit-learn's digits (upsampled to 16x16 by default) and the clean
training split (source statistics, EATA's Fisher). Its images are drawn at random per batch
(``sampling="random"``) or in passes over the held-out split (``"epoch"``: every image once before any repeats).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lowrank_lit.data.digits import DigitsDataModule
from lowrank_lit.seeding import run_seed

__all__ = ["CORRUPTIONS", "DEFAULT_LEVELS", "RESERVOIR_DOMAINS", "STREAM_SETTINGS", "corrupt", "corruption_stream", "visits", "index_plan",
           "StreamDataset", "DigitsCorruptionDataModule"]

#: the stream orders: two over whole visits (csc, cdc) and three harder ones built on the CSC visits
STREAM_SETTINGS = ("csc", "cdc", "mixed", "correlated", "gradual")


def _gaussian_noise(x: torch.Tensor, g: torch.Generator, sigma: float) -> torch.Tensor:
    return x + sigma * torch.randn(x.shape, generator=g)


def _impulse_noise(x: torch.Tensor, g: torch.Generator, fraction: float) -> torch.Tensor:
    hit = torch.rand(x.shape, generator=g) < fraction
    salt = (torch.rand(x.shape, generator=g) < 0.5).to(x.dtype)
    return torch.where(hit, salt, x)


def _blur(x: torch.Tensor, g: torch.Generator, kernel: float) -> torch.Tensor:
    size = int(kernel)
    if size not in (3, 5):
        raise ValueError(f"corrupt: blur level={kernel!r} (binomial kernel size); allowed: 3, 5")
    k1 = torch.tensor([1.0, 2.0, 1.0]) if size == 3 else torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
    k = (k1[:, None] * k1[None, :]) / k1.sum() ** 2  # (size, size) binomial
    c, pad = x.shape[1], size // 2
    w = k.expand(c, 1, size, size).to(x.dtype)
    for _ in range(2):
        x = F.conv2d(F.pad(x, (pad, pad, pad, pad), mode="replicate"), w, groups=c)
    return x


def _contrast(x: torch.Tensor, g: torch.Generator, factor: float) -> torch.Tensor:
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return (x - mean) * factor + mean


def _inversion(x: torch.Tensor, g: torch.Generator, level: float) -> torch.Tensor:
    return 1.0 - x


def _brightness(x: torch.Tensor, g: torch.Generator, offset: float) -> torch.Tensor:
    return (1.0 - offset) * x + offset


def _shift(x: torch.Tensor, g: torch.Generator, pixels: float) -> torch.Tensor:
    """Each image moved by ``pixels`` in one of the 8 directions (drawn per image), zeros shifted in."""
    n = int(pixels)
    dirs = [(dy, dx) for dy in (-n, 0, n) for dx in (-n, 0, n) if (dy, dx) != (0, 0)]
    pick = torch.randint(len(dirs), (x.shape[0],), generator=g)
    out = torch.zeros_like(x)
    H, W = x.shape[-2:]
    for i, j in enumerate(pick.tolist()):
        dy, dx = dirs[j]
        out[i, :, max(dy, 0):H + min(dy, 0), max(dx, 0):W + min(dx, 0)] = x[i, :, max(-dy, 0):H + min(-dy, 0), max(-dx, 0):W + min(-dx, 0)]
    return out


def _occluder(x: torch.Tensor, g: torch.Generator, side: float) -> torch.Tensor:
    """A ``side`` x ``side`` black square at a random place in each image."""
    s = int(side)
    H, W = x.shape[-2:]
    top = torch.randint(H - s + 1, (x.shape[0],), generator=g)
    left = torch.randint(W - s + 1, (x.shape[0],), generator=g)
    out = x.clone()
    for i, (t, lft) in enumerate(zip(top.tolist(), left.tolist(), strict=True)):
        out[i, :, t:t + s, lft:lft + s] = 0.0
    return out


CORRUPTIONS: dict[str, Callable[[torch.Tensor, torch.Generator, float], torch.Tensor]] = {
    "gaussian_noise": _gaussian_noise,
    "impulse_noise": _impulse_noise,
    "blur": _blur,
    "contrast": _contrast,
    "inversion": _inversion,
    "brightness": _brightness,
    "shift": _shift,
    "occluder": _occluder,
}

#: the severity of each corruption when none is given (the ReservoirTTA experiment's; ``shift``: 1 px, ``occluder``: 4 px)
DEFAULT_LEVELS: dict[str, float] = {"gaussian_noise": 0.5, "impulse_noise": 0.15, "blur": 5, "contrast": 0.25,
                                    "inversion": 0.0, "brightness": 0.4, "shift": 1, "occluder": 4}

#: the ReservoirTTA stream's six domains (the default of :class:`DigitsCorruptionDataModule`)
RESERVOIR_DOMAINS: tuple[str, ...] = ("gaussian_noise", "impulse_noise", "blur", "contrast", "inversion", "brightness")


def corrupt(x: torch.Tensor, name: str, generator: torch.Generator | None = None, level: float | None = None) -> torch.Tensor:
    """Apply corruption ``name`` (``clean`` = identity) at severity ``level`` (None: :data:`DEFAULT_LEVELS`) to images
    in [0, 1]; the result is clipped to [0, 1]."""
    if name == "clean":
        return x.clone()
    if name not in CORRUPTIONS:
        raise ValueError(f"corrupt: name={name!r}; allowed: clean, {', '.join(CORRUPTIONS)}")
    lvl = DEFAULT_LEVELS[name] if level is None else float(level)
    return CORRUPTIONS[name](x, generator or torch.Generator().manual_seed(0), lvl).clamp(0.0, 1.0)


def corruption_stream(domains: list[str], recurrences: int, batches_per_visit: int, setting: str = "csc",
                      seed: int = 0) -> list[tuple[int, int]]:
    """The order of test batches as ``(domain index, recurrence index)`` pairs (see the module docstring); the
    settings built on CSC visits (``mixed``, ``correlated``, ``gradual``) get the CSC order."""
    if setting not in STREAM_SETTINGS:
        raise ValueError(f"corruption_stream: setting={setting!r}; allowed: {', '.join(STREAM_SETTINGS)}")
    if recurrences < 1 or batches_per_visit < 1 or not domains:
        raise ValueError(f"corruption_stream: recurrences={recurrences}, batches_per_visit={batches_per_visit}, "
                         f"domains={domains}; allowed: >= 1, >= 1, non-empty")
    total = recurrences * len(domains) * batches_per_visit
    if setting != "cdc":
        return [(d, r) for r in range(recurrences) for d in range(len(domains)) for _ in range(batches_per_visit)]
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[int, int]] = []
    visits = [0] * len(domains)
    prev = -1
    while len(out) < total:
        d = int(torch.randint(len(domains), (1,), generator=g))
        if d == prev and len(domains) > 1:
            continue
        n = int(torch.randint(1, 2 * batches_per_visit + 1, (1,), generator=g))
        out += [(d, visits[d])] * min(n, total - len(out))
        visits[d] += 1
        prev = d
    return out


def visits(order: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Runs of equal ``(domain, recurrence)`` in a stream order: ``(domain, recurrence, batches)`` each."""
    out: list[tuple[int, int, int]] = []
    for d, r in order:
        if out and out[-1][:2] == (d, r):
            out[-1] = (d, r, out[-1][2] + 1)
        else:
            out.append((d, r, 1))
    return out


def index_plan(n: int, labels: torch.Tensor, n_domains: int, recurrences: int, batches_per_visit: int, batch_size: int,
               setting: str = "csc", seed: int = 0, dirichlet_alpha: float = 0.01, dirichlet_slots: int | None = None,
               severity: int = 5) -> list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]:
    """The stream of a corruption release that stores the same ``n`` images (``labels`` (n,)) once per corruption and
    severity (CIFAR-10-C, ImageNet-C), as one entry per batch: ``(domain (B,), recurrence, image index (B,),
    severity (B,))``. ``csc`` / ``cdc``: each visit of a corruption reads a new seeded order of its images (one
    order per visit, continued where a CDC run left it); ``mixed``, ``correlated`` and ``gradual`` build on the CSC
    visits as :class:`DigitsCorruptionDataModule` does (every image from a random corruption; the visit's images in a
    Dirichlet(``dirichlet_alpha``) label order over ``dirichlet_slots`` slots, None: one per batch; severity 1 -> 5
    -> 1 inside the visit). Other settings read ``severity``. A last batch of a visit may be short when
    ``batches_per_visit * batch_size > n``."""
    order = corruption_stream(list(range(n_domains)), recurrences, batches_per_visit, setting, seed)
    g = torch.Generator().manual_seed(seed)
    plan: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = []
    if setting in ("csc", "cdc"):
        cursor: dict[int, int] = {}
        perms: dict[int, torch.Tensor] = {}
        for d, r in order:
            if cursor.get(d, batches_per_visit) >= batches_per_visit:  # a new visit: a new image order
                cursor[d], perms[d] = 0, torch.randperm(n, generator=g)
            idx = perms[d][cursor[d] * batch_size : (cursor[d] + 1) * batch_size]
            plan.append((torch.full((len(idx),), d), r, idx, torch.full((len(idx),), severity)))
            cursor[d] += 1
        return plan
    from lowrank_lit.data.stream import dirichlet_order, severity_ramp

    for d, r, n_batches in visits(order):
        perm = torch.randperm(n, generator=g)[: n_batches * batch_size]
        if setting == "correlated":
            perm = perm[dirichlet_order(labels[perm], dirichlet_slots or n_batches, dirichlet_alpha, g)]
        ramp = severity_ramp(n_batches)
        for j, idx in enumerate(torch.split(perm, batch_size)):
            k = len(idx)
            doms = torch.randint(n_domains, (k,), generator=g) if setting == "mixed" else torch.full((k,), d)
            plan.append((doms, r, idx, torch.full((k,), ramp[j] if setting == "gradual" else severity)))
    return plan


class StreamDataset(Dataset):
    """Pre-built batches ``(x (B, C, H, W), y (B,), domain (B,), recurrence (B,))``; use with ``batch_size=None``."""

    def __init__(self, batches: list[tuple[torch.Tensor, ...]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.batches[i]


class DigitsCorruptionDataModule(DigitsDataModule):
    """Digits (16x16, pixels / 16) as a corruption stream for ``lowrank test``; see the module docstring.

    The split (``test_fraction``, ``val_fraction``, ``split_seed``) must match the source model's
    training config so that the stream only holds images the source model never saw (the card:
    ~1000 train / 797 test).

    Args:
        corruptions: domain names in stream order. Default: the six of the ReservoirTTA experiment.
        levels: severity per corruption name (see :func:`corrupt`); the others keep :data:`DEFAULT_LEVELS`. Default: None.
        recurrences: passes over all domains. Default: 6 (card).
        batches_per_visit: batches per domain visit. Default: 12 (card).
        batch_size: images per batch. Default: 64 (card).
        setting: one of :data:`STREAM_SETTINGS`: ``csc`` (fixed order), ``cdc`` (random runs), ``mixed``,
            ``correlated``, ``gradual`` (module docstring). Default: csc.
        stream_seed: seed of the sampled images, the corruption noise and the CDC order; None: the run seed
            (``seed_everything``). Default: 0.
        image_size: side after bilinear upsampling. Default: 16 (card).
        test_fraction: held-out fraction (the stream's images). Default: 0.4435 (797 of 1797).
        val_fraction: validation fraction of the source split. Default: 0.01.
        split_seed: seed of the stratified split. Default: 0.
        sampling: ``random`` (each batch drawn afresh from the held-out images) or ``epoch`` (consecutive
            slices of shuffled passes over them). Default: random.
        dirichlet_alpha: ``correlated``: the concentration of the label order. Default: 0.01.
        dirichlet_slots: ``correlated``: time slots per visit; None: one per batch. Default: None.
    """

    def __init__(
        self,
        corruptions: list[str] | None = None,
        levels: dict[str, float] | None = None,
        recurrences: int = 6,
        batches_per_visit: int = 12,
        batch_size: int = 64,
        setting: str = "csc",
        stream_seed: int | None = 0,
        image_size: int = 16,
        test_fraction: float = 0.4435,
        val_fraction: float = 0.01,
        split_seed: int = 0,
        sampling: str = "random",
        dirichlet_alpha: float = 0.01,
        dirichlet_slots: int | None = None,
    ) -> None:
        super().__init__(image_size=image_size, channels=1, normalize=False, flatten=False, batch_size=batch_size,
                         val_fraction=val_fraction, test_fraction=test_fraction, split_seed=split_seed)
        self.corruptions = list(RESERVOIR_DOMAINS) if corruptions is None else list(corruptions)
        unknown = [c for c in self.corruptions if c not in CORRUPTIONS and c != "clean"]
        if unknown or not self.corruptions:
            raise ValueError(f"DigitsCorruptionDataModule: corruptions={self.corruptions!r}; allowed: clean, {', '.join(CORRUPTIONS)}")
        self.levels = dict(levels or {})
        bad = [k for k in self.levels if k not in CORRUPTIONS]
        if bad:
            raise ValueError(f"DigitsCorruptionDataModule: levels has {bad!r}; allowed keys: {', '.join(CORRUPTIONS)}")
        if sampling not in ("random", "epoch"):
            raise ValueError(f"DigitsCorruptionDataModule: sampling={sampling!r}; allowed: random, epoch")
        if not dirichlet_alpha > 0 or (dirichlet_slots is not None and dirichlet_slots < 1):
            raise ValueError(f"DigitsCorruptionDataModule: dirichlet_alpha={dirichlet_alpha}, dirichlet_slots={dirichlet_slots}; "
                             "allowed: > 0, None or >= 1")
        self.dirichlet_alpha, self.dirichlet_slots = dirichlet_alpha, dirichlet_slots
        self.order = corruption_stream(self.corruptions, recurrences, batches_per_visit, setting, run_seed(stream_seed))
        self.recurrences, self.batches_per_visit, self.setting, self.stream_seed = recurrences, batches_per_visit, setting, stream_seed
        self.sampling = sampling
        self.stream: StreamDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.stream is not None:
            return
        assert self.test_set is not None
        x, y = self.test_set.tensors
        g = torch.Generator().manual_seed(run_seed(self.stream_seed))
        if self.setting in ("mixed", "correlated", "gradual"):
            self.stream = StreamDataset(self._harder_stream(x, y, g))
            return
        batches = []
        pool = [torch.empty(0, dtype=torch.long)]
        for d, r in self.order:
            idx = self._draw(len(y), g, pool)
            name = self.corruptions[d]
            xb = corrupt(x[idx], name, g, self.levels.get(name))
            n = len(idx)
            batches.append((xb, y[idx], torch.full((n,), d), torch.full((n,), r)))
        self.stream = StreamDataset(batches)

    def _draw(self, n: int, g: torch.Generator, pool: list[torch.Tensor]) -> torch.Tensor:
        """The held-out indices of the next batch (``sampling``); ``pool`` holds the rest of the current shuffled
        passes (``epoch``) and is updated in place."""
        if self.sampling == "random":
            return torch.randperm(n, generator=g)[: self.batch_size]
        while len(pool[0]) < min(self.batch_size, n):  # the next slice of shuffled passes over the held-out images
            pool[0] = torch.cat([pool[0], torch.randperm(n, generator=g)])
        idx, pool[0] = pool[0][: self.batch_size], pool[0][self.batch_size:]
        return idx

    def _harder_stream(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
        """The ``mixed``, ``correlated`` and ``gradual`` streams over the CSC visits (module docstring)."""
        from lowrank_lit.data.stream import dirichlet_order, severity_ramp

        pool = [torch.empty(0, dtype=torch.long)]
        batches = []
        for d, r, n_batches in visits(self.order):
            ramp = severity_ramp(n_batches)
            visit = []
            for j in range(n_batches):
                bi = self._draw(len(y), g, pool)
                n = len(bi)
                if self.setting == "mixed":  # every image from a domain of its own
                    doms = torch.randint(len(self.corruptions), (n,), generator=g)
                    xb = x[bi].clone()
                    for k in torch.unique(doms).tolist():
                        name = self.corruptions[k]
                        xb[doms == k] = corrupt(x[bi][doms == k], name, g, self.levels.get(name))
                    visit.append((xb, y[bi], doms, torch.full((n,), r)))
                    continue
                name = self.corruptions[d]
                xb = corrupt(x[bi], name, g, self.levels.get(name))
                if self.setting == "gradual":  # severity s of 5: the blend of clean and fully corrupted
                    xb = x[bi] + (ramp[j] / 5.0) * (xb - x[bi])
                visit.append((xb, y[bi], torch.full((n,), d), torch.full((n,), r)))
            if self.setting == "correlated":  # the visit's corrupted images, reordered: a pure change of order
                whole = [torch.cat(t) for t in zip(*visit, strict=True)]
                perm = dirichlet_order(whole[1], self.dirichlet_slots or n_batches, self.dirichlet_alpha, g)
                sizes = [len(t[1]) for t in visit]
                visit = list(zip(*(torch.split(t[perm], sizes) for t in whole), strict=True))
            batches += visit
        return batches

    def source_dataloader(self, batch_size: int | None = None, generator: torch.Generator | None = None) -> DataLoader:
        """Clean training images (shuffled, with replacement batches of the stream's size): source statistics."""
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=batch_size or self.batch_size, shuffle=True, drop_last=True, generator=generator)

    def test_dataloader(self) -> DataLoader:
        assert self.stream is not None
        return DataLoader(self.stream, batch_size=None, shuffle=False)

