"""The model: a Llama-family transformer in plain PyTorch, its config, and loading a checkpoint."""
