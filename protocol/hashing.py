"""Chained prefix block hashes, shared by the gateway and the worker.

    h[-1] = xxh3_128(b"spillway-root" || hash_seed || model)
    h[i]  = xxh3_128(h[i-1] || tokens_i as little-endian uint32 || extra_i)

Only full blocks are hashed. `extra_0` is the request's cache salt (empty without one);
later blocks carry no extra. 128-bit digests are trusted without comparing tokens.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated

import msgspec

import xxhash

from spillway.protocol.messages import BlockHash

DEFAULT_HASH_SEED = b"spillway-v1"
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)


def root_hash(hash_seed: bytes, model: str) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(b"spillway-root" + hash_seed + model.encode()))


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (`Generate.prompt_token_ids` on the wire);
    OverflowError for an id outside [0, 2**32)."""
    packed = array(_UINT32, token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def ids_below(token_ids: Sequence[int], vocab_size: int) -> bool:
    """Whether every id lies in [0, vocab_size): one pass in C (min() and max() take twice as long)."""
    try:
        msgspec.convert(token_ids, _ids_below_type(vocab_size))
    except msgspec.ValidationError:
        return False
    return True


@functools.lru_cache(maxsize=4)
def _ids_below_type(vocab_size: int) -> type:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def num_token_ids(token_ids: Sequence[int] | bytes) -> int:
    """How many ids `Generate.prompt_token_ids` holds, packed or not."""
    return len(token_ids) // 4 if isinstance(token_ids, bytes) else len(token_ids)


def unpack_token_ids(token_ids: Sequence[int] | bytes) -> list[int]:
    """`Generate.prompt_token_ids` as a list, packed or not."""
    if not isinstance(token_ids, bytes):
        return list(token_ids)
    return token_id_array(token_ids).tolist()


def token_id_array(packed: bytes) -> array:
    """Ids `pack_token_ids` packed, as an array of native uint32: 4 bytes an id, where a list
    holds an 8-byte pointer to a 28-byte int object for each."""
    ids = array(_UINT32, packed)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    data = parent + struct.pack(f"<{len(tokens)}I", *tokens) + extra
    return BlockHash(xxhash.xxh3_128_digest(data))


def block_hashes(
    token_ids: Sequence[int] | bytes,
    block_size: int,
    root: BlockHash,
    cache_salt: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` (or of the ids `pack_token_ids` packed), from
    block `start` on.

    To extend an existing chain pass `start` (the number of blocks already hashed) and
    `parent` (the hash of block start-1). The salt applies to block 0 only, so a chain also
    goes on from any of its hashes given as `root`, unsalted, with only the ids after its block:
    `block_hashes(ids[k * block_size:], block_size, hashes[k - 1])` == `hashes[k:]`.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start > 0 and parent is None:
        raise ValueError("extending a chain needs the parent hash")
    salt = cache_salt.encode() if cache_salt else b""
    prev = root if start == 0 else parent
    hashes: list[BlockHash] = []
    step = block_size * 4
    packed = isinstance(token_ids, bytes)
    end = (len(token_ids) // 4 if packed else len(token_ids)) // block_size
    if end <= start:
        return hashes
    # Every block's bytes packed at once, as `hash_block` packs one (this is the prompt's hot
    # path: ~3x faster than packing block by block), then cut into blocks by struct in C (a
    # fifth faster than slicing by offsets in Python); bytes concatenate with the parent faster
    # than memoryview slices.
    if packed:
        raw = token_ids[start * step: end * step]
    else:
        raw = pack_token_ids(token_ids[start * block_size: end * block_size])
    digest = xxhash.xxh3_128_digest
    append = hashes.append
    blocks = struct.iter_unpack(f"{step}s", raw)
    if start == 0:  # the salt goes into block 0 only
        prev = digest(b"".join((prev, next(blocks)[0], salt)))
        append(BlockHash(prev))
    for (block,) in blocks:  # BlockHash is bytes at run time: no wrapper call
        prev = digest(prev + block)
        append(prev)
    return hashes
