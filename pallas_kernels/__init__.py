"""Pallas kernels for eaglejax (tree attention, paged attention) and their XLA references."""

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_kv import write_paged_kv
from pallas_kernels.reference import paged_attention_reference, tree_attention_reference
from pallas_kernels.tree_attention import tree_attention

__all__ = ["paged_attention", "paged_attention_reference", "tree_attention",
           "tree_attention_reference", "write_paged_kv"]
