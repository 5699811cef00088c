"""Reading and writing model files: GGUF, Hugging Face directories (safetensors), eaglejax's
own checkpoints, and exports for other frameworks. `target_loader.load_target` is the one
entry point for a target model; importing this package loads none of its modules."""
