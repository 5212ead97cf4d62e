"""The worker: turns a scheduled step into one flat forward pass over the paged KV cache."""
