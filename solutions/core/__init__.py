"""The engine core: sequences, the block pool and block manager (the KV cache manager), the scheduler."""
