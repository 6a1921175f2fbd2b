"""lowrank_lit: NeurIPS 2025 low-rank and adaptation methods as PyTorch Lightning components.

Importing the package is cheap: it pulls in neither Lightning nor timm/transformers. Import the
pieces you need from their modules, e.g. ``from lowrank_lit.data import DigitsDataModule``.
"""

__version__ = "0.1.0"
