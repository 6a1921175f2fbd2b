"""A stream of corrupted test batches for test-time adaptation: recurring (CSC) or random (CDC) domains.

The six corruptions of the ReservoirTTA CPU experiment (paper 11, method card section 4) act on
images in [0, 1] of shape (B, C, H, W): ``gaussian_noise`` (sigma 0.5), ``impulse_noise`` (15 % of the
pixels set to 0 or 1), ``blur`` (two passes of a 5x5 binomial filter), ``contrast`` (x 0.25 around
the image mean), ``inversion`` (1 - x) and ``brightness`` (0.6 x + 0.4). Results are clipped to
[0, 1] (inferred). Each corruption draws its noise from a generator, so the stream is reproducible.

``corruption_stream`` orders (domain, batch) visits: ``csc`` = the corruptions in a fixed order,
``recurrences`` times (continual structured change); ``cdc`` = runs of random length (1 .. 2 x
batches_per_visit) of randomly chosen domains, never the same twice in a row, with the same total
number of batches (continual dynamic change). ``DigitsCorruptionDataModule`` serves the stream
built from the held-out split of scikit-learn's digits (upsampled to 16x16) and the clean training
split (source statistics, EATA's Fisher).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lowrank_lit.data.digits import DigitsDataModule

__all__ = ["CORRUPTIONS", "corrupt", "corruption_stream", "StreamDataset", "DigitsCorruptionDataModule"]


def _gaussian_noise(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return x + 0.5 * torch.randn(x.shape, generator=g)


def _impulse_noise(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    hit = torch.rand(x.shape, generator=g) < 0.15
    salt = (torch.rand(x.shape, generator=g) < 0.5).to(x.dtype)
    return torch.where(hit, salt, x)


def _blur(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    k1 = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
    k = (k1[:, None] * k1[None, :]) / 256.0  # 5x5 binomial
    c = x.shape[1]
    w = k.expand(c, 1, 5, 5).to(x.dtype)
    for _ in range(2):
        x = F.conv2d(F.pad(x, (2, 2, 2, 2), mode="replicate"), w, groups=c)
    return x


def _contrast(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return (x - mean) * 0.25 + mean


def _inversion(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return 1.0 - x


def _brightness(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return 0.6 * x + 0.4


CORRUPTIONS: dict[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = {
    "gaussian_noise": _gaussian_noise,
    "impulse_noise": _impulse_noise,
    "blur": _blur,
    "contrast": _contrast,
    "inversion": _inversion,
    "brightness": _brightness,
}


def corrupt(x: torch.Tensor, name: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Apply corruption ``name`` (``clean`` = identity) to images in [0, 1]; the result is clipped to [0, 1]."""
    if name == "clean":
        return x.clone()
    if name not in CORRUPTIONS:
        raise ValueError(f"corrupt: name={name!r}; allowed: clean, {', '.join(CORRUPTIONS)}")
    return CORRUPTIONS[name](x, generator or torch.Generator().manual_seed(0)).clamp(0.0, 1.0)


def corruption_stream(domains: list[str], recurrences: int, batches_per_visit: int, setting: str = "csc",
                      seed: int = 0) -> list[tuple[int, int]]:
    """The order of test batches as ``(domain index, recurrence index)`` pairs (see the module docstring)."""
    if setting not in ("csc", "cdc"):
        raise ValueError(f"corruption_stream: setting={setting!r}; allowed: csc, cdc")
    if recurrences < 1 or batches_per_visit < 1 or not domains:
        raise ValueError(f"corruption_stream: recurrences={recurrences}, batches_per_visit={batches_per_visit}, "
                         f"domains={domains}; allowed: >= 1, >= 1, non-empty")
    total = recurrences * len(domains) * batches_per_visit
    if setting == "csc":
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
        corruptions: domain names in stream order. Default: the six of the card.
        recurrences: passes over all domains. Default: 6 (card).
        batches_per_visit: batches per domain visit. Default: 12 (card).
        batch_size: images per batch. Default: 64 (card).
        setting: ``csc`` (fixed order) or ``cdc`` (random runs). Default: csc.
        stream_seed: seed of the sampled images, the corruption noise and the CDC order. Default: 0.
        image_size: side after bilinear upsampling. Default: 16 (card).
        test_fraction: held-out fraction (the stream's images). Default: 0.4435 (797 of 1797).
        val_fraction: validation fraction of the source split. Default: 0.01.
        split_seed: seed of the stratified split. Default: 0.
    """

    def __init__(
        self,
        corruptions: list[str] | None = None,
        recurrences: int = 6,
        batches_per_visit: int = 12,
        batch_size: int = 64,
        setting: str = "csc",
        stream_seed: int = 0,
        image_size: int = 16,
        test_fraction: float = 0.4435,
        val_fraction: float = 0.01,
        split_seed: int = 0,
    ) -> None:
        super().__init__(image_size=image_size, channels=1, normalize=False, flatten=False, batch_size=batch_size,
                         val_fraction=val_fraction, test_fraction=test_fraction, split_seed=split_seed)
        self.corruptions = list(CORRUPTIONS) if corruptions is None else list(corruptions)
        unknown = [c for c in self.corruptions if c not in CORRUPTIONS and c != "clean"]
        if unknown or not self.corruptions:
            raise ValueError(f"DigitsCorruptionDataModule: corruptions={self.corruptions!r}; allowed: clean, {', '.join(CORRUPTIONS)}")
        self.order = corruption_stream(self.corruptions, recurrences, batches_per_visit, setting, stream_seed)
        self.recurrences, self.batches_per_visit, self.setting, self.stream_seed = recurrences, batches_per_visit, setting, stream_seed
        self.stream: StreamDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.stream is not None:
            return
        assert self.test_set is not None
        x, y = self.test_set.tensors
        g = torch.Generator().manual_seed(self.stream_seed)
        batches = []
        for d, r in self.order:
            idx = torch.randperm(len(y), generator=g)[: self.batch_size]
            xb = corrupt(x[idx], self.corruptions[d], g)
            n = len(idx)
            batches.append((xb, y[idx], torch.full((n,), d), torch.full((n,), r)))
        self.stream = StreamDataset(batches)

    def source_dataloader(self, batch_size: int | None = None, generator: torch.Generator | None = None) -> DataLoader:
        """Clean training images (shuffled, with replacement batches of the stream's size): source statistics."""
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=batch_size or self.batch_size, shuffle=True, drop_last=True, generator=generator)

    def test_dataloader(self) -> DataLoader:
        assert self.stream is not None
        return DataLoader(self.stream, batch_size=None, shuffle=False)

