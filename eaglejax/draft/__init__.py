"""EAGLE draft heads: the head model, `Draft`, and the checkpoint converters."""

from eaglejax.draft.config import DraftConfig
from eaglejax.draft.draft import Draft
from eaglejax.draft.formats import export_reference, export_speculators, save_draft
from eaglejax.draft.loading import load_draft

__all__ = ["Draft", "DraftConfig", "export_reference", "export_speculators", "load_draft",
           "save_draft"]
