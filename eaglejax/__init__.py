"""eaglejax: speculative decoding (EAGLE-1/2/3, dynamic trees, parallel drafting) in JAX."""

from eaglejax.config import ModelConfig
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.draft import Draft, DraftModel, load_draft, load_draft_model
from eaglejax.errors import ConfigError, EaglejaxError, InputError, LoadError
from eaglejax.decoding.token_logprobs import TokenLogprob
from eaglejax.generate import Generation, GenerationMetrics, generate
from eaglejax.loading.target_loader import load_target
from eaglejax.sharding import make_mesh
from eaglejax.target import Target
from eaglejax.version import __version__

__all__ = [
    "ConfigError", "Draft", "DraftModel", "EaglejaxError", "Generation", "GenerationMetrics",
    "InputError", "LoadError", "ModelConfig", "SpecConfig", "Target", "generate", "load_draft",
    "load_draft_model", "load_target", "TokenLogprob",
    "__version__", "make_mesh",
]
