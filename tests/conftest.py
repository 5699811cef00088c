"""Shared test set-up: CPU float32, small random Hugging Face models as parity oracles."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
