"""lowrank_lit: NeurIPS 2025 low-rank and adaptation methods as PyTorch Lightning components.

Importing the package is cheap: it pulls in neither Lightning nor timm/transformers. Import the
pieces you need from their modules, e.g. ``from lowrank_lit.data import DigitsDataModule``.
"""

__version__ = "0.1.0"

#: The package order, top to bottom. A module imports only from its own package or a package further
#: down this list (``tests/test_structure.py`` keeps it so, function-level imports included); the
#: single modules at the end import nothing of the package.
LAYERS = (
    "__main__", "cli", "launch", "methods", "studies", "callbacks", "tta", "models", "data", "envs", "optim", "nn",
    "sharding", "bench", "linalg", "loggers", "report", "registry", "artifacts", "checkpoint", "hub", "metrics", "seeding", "stats", "argtypes",
)
