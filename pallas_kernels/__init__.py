"""Pallas kernels for eaglejax (tree attention, parallel drafting) and their XLA references."""

from pallas_kernels.reference import tree_attention_reference

__all__ = ["tree_attention_reference"]
