"""DigitsDataModule and TensorDataModule."""

from __future__ import annotations

import pytest
import torch

from lowrank_lit.data import DigitsDataModule, TensorDataModule

N_DIGITS = 1797


def _setup(**kw):
    dm = DigitsDataModule(**kw)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize(
    ("kw", "shape"),
    [
        ({}, (1, 8, 8)),
        ({"image_size": 32, "channels": 3}, (3, 32, 32)),
        ({"image_size": 16, "flatten": True}, (256,)),
    ],
)
def test_shapes(kw, shape):
    dm = _setup(batch_size=7, **kw)
    x, y = next(iter(dm.train_dataloader()))
    assert tuple(x.shape) == (7, *shape) == (7, *dm.input_shape)
    assert y.dtype == torch.long and y.shape == (7,)


def test_split_is_stratified_disjoint_and_seeded():
    dm = _setup()
    sizes = [len(s) for s in (dm.train_set, dm.val_set, dm.test_set)]
    assert sum(sizes) == N_DIGITS
    assert abs(sizes[1] - 0.15 * N_DIGITS) <= 2 and abs(sizes[2] - 0.15 * N_DIGITS) <= 2
    xs = [s.tensors[0].flatten(1) for s in (dm.train_set, dm.val_set, dm.test_set)]
    _, y = dm._images()
    train_idx, val_idx, test_idx = dm._split(y)
    together = torch.cat([train_idx, val_idx, test_idx])
    assert torch.equal(together.sort().values, torch.arange(N_DIGITS))  # disjoint and complete
    for split in (dm.val_set, dm.test_set):
        counts = torch.bincount(split.tensors[1], minlength=10).float() / len(split)
        assert counts.min() > 0.08 and counts.max() < 0.12  # every class ~10% in every split
    again = _setup()
    for a, b in zip(xs, [s.tensors[0].flatten(1) for s in (again.train_set, again.val_set, again.test_set)], strict=True):
        assert torch.equal(a, b)
    other = _setup(split_seed=1)
    assert not torch.equal(other.test_set.tensors[0], dm.test_set.tensors[0])


def test_split_seed_none_follows_the_run_seed():
    from lightning.pytorch import seed_everything

    seed_everything(1)
    follows = _setup(split_seed=None)
    assert follows.resolved_split_seed() == 1
    assert torch.equal(follows.test_set.tensors[0], _setup(split_seed=1).test_set.tensors[0])
    seed_everything(0)
    assert torch.equal(_setup(split_seed=None).test_set.tensors[0], _setup(split_seed=0).test_set.tensors[0])


def test_normalization_uses_training_statistics():
    dm = _setup(image_size=16)
    x = dm.train_set.tensors[0]
    assert abs(x.mean().item()) < 1e-5 and abs(x.std().item() - 1) < 1e-4
    raw = _setup(normalize=False)
    assert raw.train_set.tensors[0].min() >= 0 and raw.train_set.tensors[0].max() <= 1


def test_native_size_matches_load_digits():
    from sklearn.datasets import load_digits

    raw = _setup(normalize=False, flatten=True)
    images = torch.as_tensor(load_digits().data, dtype=torch.float32) / 16
    # every training row is one of the original images, unchanged
    first = raw.train_set.tensors[0][0]
    assert torch.isclose(images, first).all(dim=1).any()


def test_channels_repeat_grey():
    x = _setup(channels=3).train_set.tensors[0]
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 1], x[:, 2])


@pytest.mark.parametrize(
    ("kw", "arg", "allowed"),
    [
        ({"image_size": 0}, "image_size=0", "8..64"),
        ({"image_size": 65}, "image_size=65", "8..64"),
        ({"channels": 2}, "channels=2", "1 or 3"),
        ({"batch_size": 0}, "batch_size=0", ">= 1"),
        ({"val_fraction": 0.6}, "val_fraction=0.6", "(0, 0.5)"),
    ],
)
def test_bad_arguments(kw, arg, allowed):
    with pytest.raises(ValueError) as exc:
        DigitsDataModule(**kw)
    assert arg in str(exc.value) and allowed in str(exc.value)


def test_tensor_datamodule():
    x, y = torch.randn(10, 3), torch.arange(10)
    dm = TensorDataModule(train=(x, y), batch_size=4, shuffle=False)
    dm.setup()
    batches = list(dm.train_dataloader())
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b[1] for b in batches]), y)
    assert dm.val_dataloader() == []  # no validation split: Lightning skips the loop
    with pytest.raises(ValueError, match="differ in length"):
        bad = TensorDataModule(train=(x, y[:5]))
        bad.setup()
    with pytest.raises(ValueError, match="train=None"):
        TensorDataModule().setup()


def test_cifar10_needs_user_data(tmp_path):
    from lowrank_lit.data import CIFAR10DataModule

    dm = CIFAR10DataModule(data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="has no cifar-10-batches-py/.*nothing is downloaded"):
        dm.setup("fit")
    assert not any(tmp_path.iterdir())  # and nothing was fetched or created
    with pytest.raises(ValueError, match="val_size=50000"):
        CIFAR10DataModule(data_dir=str(tmp_path), val_size=50000)
