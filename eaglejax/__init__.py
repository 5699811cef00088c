"""eaglejax: speculative decoding (EAGLE-1/2/3, dynamic trees, parallel drafting) in JAX."""

__version__ = "0.1.0"  # first: modules imported below read it

from eaglejax.config import ModelConfig
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.draft import Draft, load_draft
from eaglejax.errors import ConfigError, EaglejaxError, InputError, LoadError
from eaglejax.generate import Generation, GenerationMetrics, generate
from eaglejax.loading import load_target
from eaglejax.sharding import make_mesh
from eaglejax.target import Target

__all__ = [
    "ConfigError", "Draft", "EaglejaxError", "Generation", "GenerationMetrics", "InputError",
    "LoadError", "ModelConfig", "SpecConfig", "Target", "generate", "load_draft", "load_target",
    "make_mesh",
]
