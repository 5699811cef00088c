"""Readers and writers of draft-head checkpoint layouts.

Every reader maps a head directory to `(DraftConfig, params, d2t)`: params matching
`eaglejax.draft.head.param_shapes(config)` and d2t int32 [DV], checked against the target.
"""

from eaglejax.draft.formats.dflash import export_dflash, export_speculators_dflash, read_dflash
from eaglejax.draft.formats.eagle1 import read_eagle1
from eaglejax.draft.formats.native import read_native, save_draft
from eaglejax.draft.formats.reference import export_reference, read_reference
from eaglejax.draft.formats.speculators import export_speculators, read_speculators

READERS = {
    "eaglejax": read_native,
    "speculators": read_speculators,
    "eagle3": read_reference,
    "eagle1": read_eagle1,
    "dflash": read_dflash,
}
WRITERS = {
    "eaglejax": save_draft,
    "reference": export_reference,
    "speculators": export_speculators,
    "dflash": export_dflash,
}

__all__ = ["READERS", "WRITERS", "export_dflash", "export_reference", "export_speculators",
           "export_speculators_dflash", "read_dflash", "read_eagle1", "read_native",
           "read_reference", "read_speculators", "save_draft"]
