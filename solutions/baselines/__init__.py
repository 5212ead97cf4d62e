"""Chapter-only baselines the engine is measured against: the naive loop (ch01), the contiguous cache and its
allocator (ch02), and the static paged loop (ch03). The engine imports only the reserving KV cache manager, and
builds it only when asked for Orca's admission (`kv_reservation`, chapter 07's latency-vs-load comparison)."""
