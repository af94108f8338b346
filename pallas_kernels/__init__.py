"""Pallas kernels, each beside a pure-jnp reference (see STYLE.md).

Importing this package registers `attention_impl="pallas"` with `specjax.models.attention`
(`get_attention_impl("pallas")` imports it on first use).
"""

from specjax.models.pallas_attention import MAX_TREE_TOKENS, pallas_attention
from pallas_kernels.tree_attention import (BlockSizes, pack_tree_mask, tree_attention,
                                           tree_attention_reference, unpack_tree_mask)
from specjax.models.attention import register_attention_impl

register_attention_impl("pallas", pallas_attention)

__all__ = ["BlockSizes", "MAX_TREE_TOKENS", "pack_tree_mask", "pallas_attention",
           "tree_attention", "tree_attention_reference", "unpack_tree_mask"]
