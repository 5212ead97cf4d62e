"""Attention: the causal arithmetic every backend ends with, and backends that read a paged KV cache."""
