"""Sampling: from each sequence's logits to its next token."""
