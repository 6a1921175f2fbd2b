"""Face crops with gaze labels from your disk (for 3DPE-Gaze on real data; nothing is downloaded).

Each split is a csv with a header: ``path`` (image file, relative to ``root``) and either ``gx, gy, gz`` (gaze
vector in the camera frame, +x = the image's right, +y = up, +z = towards the camera; normalised here) or
``pitch, yaw`` (radians, the convention of :func:`lowrank_lit.data.heads.gaze_from_angles`); an optional
``glasses`` column (0/1) enables the glasses slices. ETH-XGaze's h5 files can be exported to this layout
(one png per face and the h5's ``face_gaze`` (pitch, yaw) as the two columns).

Batches are dicts ``image (B, 3, S, S)`` in [0, 1], ``gaze (B, 3)``, ``glasses (B,)`` (-1 where unknown),
``domain (B,)`` -- the keys :class:`lowrank_lit.methods.gaze_3dpe.ThreeDPEGaze` reads (the head-parameter slices
need the synthetic data's ground truth and are skipped).
"""

from __future__ import annotations

import csv
import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.heads import gaze_from_angles
from lowrank_lit.data.loader import ResumableDataLoader

__all__ = ["GazeCSVDataset", "GazeFolderDataModule"]


class GazeCSVDataset(Dataset):
    """One csv split (module docstring); images resized to ``image_size``."""

    def __init__(self, csv_path: str, root: str, image_size: int = 224, domain_index: int = 0) -> None:
        if not os.path.isfile(csv_path):
            raise FileNotFoundError(f"GazeCSVDataset: csv {csv_path!r} does not exist")
        with open(csv_path) as f:
            self.rows = list(csv.DictReader(f))
        if not self.rows:
            raise ValueError(f"GazeCSVDataset: {csv_path!r} has no rows")
        cols = set(self.rows[0])
        if "path" not in cols or not ({"gx", "gy", "gz"} <= cols or {"pitch", "yaw"} <= cols):
            raise ValueError(f"GazeCSVDataset: {csv_path!r} has columns {sorted(cols)}; needed: path and gx, gy, gz "
                             "or pitch, yaw")
        self.root, self.image_size, self.domain_index = root, image_size, domain_index

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor, resize

        r = self.rows[i]
        img = pil_to_tensor(Image.open(os.path.join(self.root, r["path"])).convert("RGB"))
        img = resize(img, [self.image_size, self.image_size], antialias=True).float() / 255  # (3, S, S)
        if "gx" in r:
            g = torch.tensor([float(r["gx"]), float(r["gy"]), float(r["gz"])])
        else:
            g = gaze_from_angles(torch.tensor([[float(r["pitch"]), float(r["yaw"])]]))[0]
        if float(g.norm()) == 0:
            raise ValueError(f"GazeCSVDataset: zero-norm gaze in row {i} of the csv ({r['path']})")
        glasses = float(r["glasses"]) if r.get("glasses") not in (None, "") else -1.0
        return {"image": img, "gaze": g / g.norm(), "glasses": torch.tensor(glasses), "domain": torch.tensor(self.domain_index)}


class GazeFolderDataModule(pl.LightningDataModule):
    """Source-domain training and validation csvs and one test csv per target domain.

    Args:
        root: the folder the csvs' ``path`` column is relative to.
        train_csv, val_csv: source-domain splits.
        test_csvs: target domains, ``{name: csv}`` (each its own test dataloader, in this order).
        image_size: side the faces are resized to. Default: 224.
        batch_size: per device. Default: 256.
        num_workers: image-decoding processes. Default: 8.
    """

    def __init__(self, root: InputPath, train_csv: InputPath, val_csv: InputPath, test_csvs: dict[str, InputPath], image_size: int = 224,
                 batch_size: int = 256, num_workers: int = 8) -> None:
        super().__init__()
        if not test_csvs:
            raise ValueError("GazeFolderDataModule: test_csvs is empty; give {name: csv} for each target domain")
        self.root, self.train_csv, self.val_csv, self.test_csvs = root, train_csv, val_csv, dict(test_csvs)
        self.image_size, self.batch_size, self.num_workers = image_size, batch_size, num_workers
        self.test_domains = list(self.test_csvs)

    def _loader(self, csv_path: str, shuffle: bool, index: int = 0) -> Any:
        ds = GazeCSVDataset(csv_path, self.root, self.image_size, index)
        # resumable: an interrupted run continues the epoch's shuffle where it stopped
        return ResumableDataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                                   persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> Any:
        return self._loader(self.train_csv, True)

    def val_dataloader(self) -> Any:
        return self._loader(self.val_csv, False)

    def test_dataloader(self) -> Any:
        return [self._loader(p, False, k) for k, p in enumerate(self.test_csvs.values())]
