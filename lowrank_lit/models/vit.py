"""Randomly initialised timm Vision Transformers sized for small images.

Built with timm's :class:`~timm.models.vision_transformer.VisionTransformer` (no weights are
downloaded). timm is imported only when a factory is called.
"""

from __future__ import annotations

from torch import nn

from lowrank_lit.sharding import shard_unit

shard_unit("timm.models.vision_transformer.Block")  # sharded runs: one FSDP group per transformer block

__all__ = ["vit_tiny", "vit_factory"]


def vit_factory(
    num_classes: int = 10,
    img_size: int = 32,
    patch_size: int = 4,
    in_chans: int = 3,
    embed_dim: int = 192,
    depth: int = 12,
    num_heads: int = 3,
    mlp_ratio: float = 4.0,
    drop_rate: float = 0.0,
    drop_path_rate: float = 0.0,
    global_pool: str = "token",
) -> nn.Module:
    """A timm ViT with the given geometry and random init.

    Args:
        num_classes: classifier outputs. Default: 10.
        img_size: input side length. Default: 32.
        patch_size: patch side length; must divide ``img_size``. Default: 4.
        in_chans: input channels. Default: 3.
        embed_dim: token width. Default: 192 (ViT-Tiny).
        depth: number of transformer blocks. Default: 12 (ViT-Tiny).
        num_heads: attention heads. Default: 3 (ViT-Tiny).
        mlp_ratio: MLP hidden width / embed_dim. Default: 4.0.
        drop_rate: dropout on the head and embeddings. Default: 0.0.
        drop_path_rate: stochastic depth rate. Default: 0.0.
        global_pool: ``token`` (class token) or ``avg`` (mean of patch tokens). Default: ``token``.

    Raises:
        ValueError: if ``patch_size`` does not divide ``img_size``, ``embed_dim`` is not a multiple
            of ``num_heads``, or ``global_pool`` is not ``token``/``avg``.
    """
    if img_size < 1 or patch_size < 1 or img_size % patch_size:
        raise ValueError(f"vit: patch_size={patch_size} must divide img_size={img_size}")
    if embed_dim % num_heads:
        raise ValueError(f"vit: embed_dim={embed_dim} must be a multiple of num_heads={num_heads}")
    if global_pool not in ("token", "avg"):
        raise ValueError(f"vit: global_pool={global_pool!r}; allowed: token, avg")
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=img_size,
        patch_size=patch_size,
        in_chans=in_chans,
        num_classes=num_classes,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=mlp_ratio,
        drop_rate=drop_rate,
        drop_path_rate=drop_path_rate,
        global_pool=global_pool,
        class_token=global_pool == "token",
    )


def vit_tiny(
    num_classes: int = 10,
    img_size: int = 32,
    patch_size: int = 4,
    in_chans: int = 3,
    drop_path_rate: float = 0.0,
    global_pool: str = "token",
) -> nn.Module:
    """ViT-Tiny (embed 192, depth 12, 3 heads, 5.4M parameters at 32x32/4), random init.

    Args:
        num_classes: classifier outputs. Default: 10.
        img_size: input side length. Default: 32.
        patch_size: patch side length. Default: 4 (an 8x8 grid of 64 patches at 32x32).
        in_chans: input channels. Default: 3.
        drop_path_rate: stochastic depth rate. Default: 0.0.
        global_pool: ``token`` or ``avg``. Default: ``token``.
    """
    return vit_factory(
        num_classes=num_classes,
        img_size=img_size,
        patch_size=patch_size,
        in_chans=in_chans,
        embed_dim=192,
        depth=12,
        num_heads=3,
        drop_path_rate=drop_path_rate,
        global_pool=global_pool,
    )
