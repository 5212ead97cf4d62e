"""Chained block hashes: the key under which prefix caching finds a block that already holds a prefix.

A *full* block's K/V are determined by its token ids and every token before it. Hashing all of that per block
would cost O(n²); chaining costs O(n):

    hash(block i) = H(hash(block i - 1) ‖ token ids of block i),      hash(block -1) = NONE_HASH

so equal hashes mean equal tokens at equal positions after equal prefixes. Only full blocks are hashed.

Why SHA-256 and not Python's `hash`: a collision would silently hand one request another prompt's K/V — wrong
outputs, or one user's prompt leaking into another's answer. Python's tuple hash is 64 bits and collisions can
be constructed; SHA-256 makes them practically impossible for about a microsecond per block. vLLM's default is
SHA-256 too (`--prefix-caching-hash-algo`).

Where this lives in vLLM: `vllm/v1/core/kv_cache_utils.py` (`hash_block_tokens`, `NONE_HASH`).
"""

import hashlib
from array import array
from collections.abc import Sequence

NONE_HASH: bytes = bytes(32)  # the "parent" of a sequence's first block: 32 zero bytes, as long as a digest

BlockHash = bytes  # a 32-byte SHA-256 digest


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block: SHA-256 of the parent's hash followed by the token ids as int64.

    `parent_block_hash` is None for a sequence's first block. Every digest has the same length, so the
    parent/token boundary is unambiguous and no two different (parent, tokens) inputs share a byte string.
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], num_tokens: int, block_size: int
) -> None:
    """Append to `block_hashes` the hash of every block that is full within `token_ids[:num_tokens]`.

    The hashes already there are kept (a sequence's hashes only ever grow), so each block is hashed once.
    """
    for i in range(len(block_hashes), num_tokens // block_size):
        parent = block_hashes[i - 1] if i > 0 else None
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size]))
