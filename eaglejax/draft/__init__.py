"""EAGLE draft heads (the head model, `Draft`, the checkpoint converters) and draft models
(`DraftModel`)."""

from eaglejax.draft.config import DraftConfig
from eaglejax.draft.draft import Draft
from eaglejax.draft.draft_model import DraftModel, load_draft_model
from eaglejax.draft.formats import (
    export_dflash,
    export_reference,
    export_speculators,
    save_draft,
)
from eaglejax.draft.loading import load_draft

__all__ = ["Draft", "DraftConfig", "DraftModel", "export_dflash", "export_reference",
           "export_speculators", "load_draft", "load_draft_model", "save_draft"]
