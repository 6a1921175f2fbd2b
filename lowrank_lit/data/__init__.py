"""LightningDataModules shared by all methods."""

from lowrank_lit.data.cifar import CIFAR10DataModule
from lowrank_lit.data.digits import DigitsDataModule
from lowrank_lit.data.tensor import TensorDataModule

__all__ = ["CIFAR10DataModule", "DigitsDataModule", "TensorDataModule"]
