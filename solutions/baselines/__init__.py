"""Chapter-only baselines the engine is measured against: the naive loop (ch01), the contiguous cache and its
allocator (ch02), and the static paged loop (ch03). The engine itself never imports them."""
