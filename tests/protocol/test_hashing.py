"""Golden vectors pin the block hash: gateway and worker (and older releases) must agree."""

import struct

import pytest
import xxhash

from spillway.protocol.hashing import DEFAULT_HASH_SEED, block_hashes, hash_block, num_token_ids, pack_token_ids, root_hash, unpack_token_ids

ROOT = root_hash(DEFAULT_HASH_SEED, "SmolLM2-135M-Instruct")


def test_root_hash_golden():
    assert ROOT.hex() == "23dad6301a5ed627ddc9971d29f43310"


def test_block_hash_is_xxh3_128_of_parent_tokens_extra():
    parent = b"\x00" * 16
    expected = xxhash.xxh3_128_digest(parent + b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x00")
    assert hash_block(parent, [1, 2, 3, 4]) == expected
    assert expected.hex() == "4e7b4f6b8cadfb2a1b1a20c2457494c4"


def test_chain_golden_only_full_blocks():
    hashes = block_hashes(list(range(40)), 16, ROOT)
    assert [h.hex() for h in hashes] == [
        "0ece20c307b2a6bba35ed47ed71ab0fc",
        "26c2a6ad9a126ab0ba74e7b9c32019d1",
    ]
    assert hashes[1] == xxhash.xxh3_128_digest(hashes[0] + struct.pack("<16I", *range(16, 32)))


def test_salt_changes_every_block_through_the_chain():
    salted = block_hashes(list(range(40)), 16, ROOT, cache_salt="tenant-a")
    assert [h.hex() for h in salted] == [
        "f343be5415aac5d8293979edafd7e1e3",
        "eecd4422b4036864061e147f7deb430a",
    ]
    assert salted[0] == xxhash.xxh3_128_digest(ROOT + struct.pack("<16I", *range(16)) + b"tenant-a")


def test_extending_a_chain_equals_hashing_at_once():
    tokens = list(range(1000, 1100))
    whole = block_hashes(tokens, 16, ROOT, cache_salt="s")
    head = block_hashes(tokens[:40], 16, ROOT, cache_salt="s")
    tail = block_hashes(tokens, 16, ROOT, cache_salt="s", start=len(head), parent=head[-1])
    assert head + tail == whole and len(whole) == 6
    # from any hash as the root, unsalted, with the ids after its block only
    assert block_hashes(tokens[2 * 16:], 16, whole[1]) == whole[2:]


def test_different_models_do_not_share_blocks():
    other = root_hash(DEFAULT_HASH_SEED, "Qwen3-8B")
    assert block_hashes([1] * 16, 16, ROOT) != block_hashes([1] * 16, 16, other)


def test_bad_arguments():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, ROOT)
    with pytest.raises(ValueError):
        block_hashes([1] * 32, 16, ROOT, start=1)


def test_the_packed_chain_equals_hashing_block_by_block():
    import random

    rng = random.Random(3)
    tokens = [rng.randrange(2**32) for _ in range(16 * 40 + 7)]
    root = root_hash(b"seed", "model")
    expected, prev = [], root
    for i in range(40):
        prev = hash_block(prev, tokens[16 * i: 16 * (i + 1)], b"salt" if i == 0 else b"")
        expected.append(prev)
    assert block_hashes(tokens, 16, root, cache_salt="salt") == expected
    assert block_hashes(tokens, 16, root, cache_salt="salt", start=25, parent=expected[24]) == expected[25:]
    assert block_hashes(tokens[:15], 16, root) == []


def test_packed_ids_hash_as_the_list_and_travel_as_little_endian_uint32():
    ids = [0, 1, 255, 256, 49151, 2**32 - 1] * 6  # 36 ids: two full blocks of 16
    packed = pack_token_ids(ids)
    assert packed[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00" and len(packed) == 4 * len(ids)
    for salt, start in ((None, 0), ("s", 0), (None, 1)):
        parent = block_hashes(ids[:16], 16, ROOT, salt)[-1] if start else None
        assert block_hashes(packed, 16, ROOT, salt, start, parent) == block_hashes(ids, 16, ROOT, salt, start, parent)
    assert unpack_token_ids(packed) == ids and num_token_ids(packed) == num_token_ids(ids) == 36
    with pytest.raises(OverflowError):
        pack_token_ids([1, -1])
