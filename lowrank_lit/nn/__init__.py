"""Shared layers used by several methods (LoRA, prompts, low-rank linear, ...)."""
