"""The model both low-rank optimizer methods (is_lowrank, nanoadam) are timed on in ``lowrank bench``: a byte-level
Llama on standard-library text, one copy per optimizer, so their rows compare like with like."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OptimizerBenchModel", "optimizer_bench_models", "galore_adamw"]


class OptimizerBenchModel:
    """One copy of the benchmark Llama with its optimizer; :meth:`step` trains it on the next batch."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], note: str) -> None:
        self.model, self.optimizer, self.batches, self.note, self.i = model, optimizer, batches, note, 0

    def step(self) -> None:
        import torch.nn.functional as F

        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        logits = self.model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def matrix_state_bytes(self) -> int:
        """Bytes of the optimizer state of the compressed (attention / MLP) matrices: the first param group."""
        from lowrank_lit.bench import tensor_bytes

        states = [self.optimizer.state[p] for p in self.optimizer.param_groups[0]["params"]]
        # galore-torch keeps its projector matrix on a GaLoreProjector object in the state, not as a tensor
        projectors = [v.ortho_matrix for st in states for v in st.values() if hasattr(v, "ortho_matrix")]
        return tensor_bytes(states, projectors)


def galore_adamw() -> Any:
    """galore-torch's ``GaLoreAdamW`` when it is installed (the ``bench`` extra), else None."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from galore_torch import GaLoreAdamW
    except Exception:  # not installed, or its bitsandbytes import fails on this machine
        return None
    return GaLoreAdamW


def optimizer_bench_models(ctx: Any, makers: dict[str, Any]) -> dict[str, OptimizerBenchModel]:
    """A byte-level Llama (d 256, 4 layers; d 64, 2 layers in quick mode) on stdlib text, one copy per optimizer
    maker ``(param_groups) -> optimizer`` (attention / MLP matrices compressed, embeddings and head dense)."""
    import copy

    from lowrank_lit.data.text import CharTextDataModule
    from lowrank_lit.models.lm import llama
    from lowrank_lit.optim import matrix_param_groups

    hidden, layers = ctx.size((256, 4), (64, 2))
    torch.manual_seed(0)
    base = llama(vocab_size=128, hidden_size=hidden, num_layers=layers, num_heads=4, intermediate_size=4 * hidden,
                 context=64).to(ctx.device)
    dm = CharTextDataModule(max_bytes=200_000, context=64, batch_size=16)
    dm.setup()
    batches = [(x.to(ctx.device), y.to(ctx.device)) for _, (x, y) in zip(range(8), dm.train_dataloader(), strict=False)]
    note = f"Llama d {hidden}, {layers} layers, batch 16 x 64 bytes"
    out = {}
    for name, make in makers.items():
        model = copy.deepcopy(base)
        out[name] = OptimizerBenchModel(model, make(matrix_param_groups(model, dense=["*embed*", "*lm_head*"])), batches, note)
    return out
