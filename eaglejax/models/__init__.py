"""Target models as pure functions: the Llama-family decoder, its KV cache, attention, RoPE."""
