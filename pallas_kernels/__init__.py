"""Pallas kernels for eaglejax (tree attention, parallel drafting) and their XLA references."""

from pallas_kernels.reference import tree_attention_reference
from pallas_kernels.tree_attention import tree_attention

__all__ = ["tree_attention", "tree_attention_reference"]
