"""Tensor parallelism: one model split across ranks by heads and hidden units, on `torch.distributed`."""
