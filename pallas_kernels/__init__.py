"""Pallas kernels, each beside a pure-jnp reference.

A leaf package: it imports jax only, never specjax, so a kernel can be tested, lowered and
benchmarked on its own. The model's adapter over it is `specjax.models.pallas_attention`.
"""

from pallas_kernels.tree_attention import (
                                           BlockSizes,
                                           kv_bytes_read,
                                           pack_tree_mask,
                                           tree_attention,
                                           tree_attention_reference,
                                           unpack_tree_mask,
)

__all__ = ["BlockSizes", "kv_bytes_read", "pack_tree_mask", "tree_attention",
           "tree_attention_reference", "unpack_tree_mask"]
