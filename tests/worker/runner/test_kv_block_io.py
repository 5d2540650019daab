"""A pool's blocks read out as bytes and written into another pool (worker/runner/kv_block_io.py):
the bytes are the blocks' in the order asked, gathered from the GPU pool and the CPU tier's into
memory of their own, and each lands in the slot it is paired with; on CUDA too, ordered on the
compute stream after the work queued before."""

from __future__ import annotations

import pytest
import torch

from spillway.worker.runner.kv_block_io import KvLayout, read_blocks, write_blocks

BLOCK_SHAPE = (2, 2, 4, 3, 8)  # layers, sides, block size, KV heads, head dim


def pool(num_blocks: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *BLOCK_SHAPE), generator=generator).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_read_in_order_land_in_their_paired_slots(dtype):
    source = pool(6, dtype)
    payload = read_blocks(source, [(4, 0), (1, 1), (2, 2)], 3)
    layout = KvLayout.of(source)
    assert layout == KvLayout(str(dtype).removeprefix("torch."), BLOCK_SHAPE, source[0].nbytes)
    assert payload.nbytes == 3 * layout.block_bytes
    assert bytes(payload[:layout.block_bytes]) == source[4].view(torch.uint8).numpy().tobytes()
    target = torch.zeros((5, *BLOCK_SHAPE), dtype=dtype)
    write_blocks(target, memoryview(payload), [(0, 3), (2, 0)])  # block 1 (source slot 1) not taken
    assert torch.equal(target[3], source[4]) and torch.equal(target[0], source[2])
    assert not target[1].any() and not target[2].any() and not target[4].any()


def test_blocks_of_both_pools_are_gathered_in_prefix_order_into_memory_of_their_own():
    gpu_pool, tier_pool = pool(6, torch.float32), pool(4, torch.float32, seed=1)
    payload = read_blocks(gpu_pool, [(5, 0), (0, 3)], 4, tier_pool, [(2, 1), (1, 2)])
    blocks = torch.from_numpy(payload.copy()).view(torch.float32).reshape(4, *BLOCK_SHAPE)
    assert torch.equal(blocks, torch.stack([gpu_pool[5], tier_pool[2], tier_pool[1], gpu_pool[0]]))
    tier_pool[2].fill_(7.0)  # the tier reuses the slot once the payload is gathered: nothing sent changes
    gpu_pool[5].fill_(7.0)
    assert torch.equal(torch.from_numpy(payload.copy()).view(torch.float32).reshape(4, *BLOCK_SHAPE)[:2],
                       blocks[:2])
    with pytest.raises(AssertionError, match="1 \\+ 2 reads for 4 blocks"):
        read_blocks(gpu_pool, [(5, 0)], 4, tier_pool, [(2, 1), (1, 2)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_read_follows_the_queued_writes_and_a_write_precedes_later_reads():
    source = pool(64, torch.bfloat16, "cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # keep the stream busy so an unordered copy would read stale blocks
        big = big @ big / 64
    source[7].fill_(3.0)  # queued behind the products
    tier = pool(4, torch.bfloat16, seed=1)
    payload = read_blocks(source, [(7, 0), (9, 2)], 3, tier, [(3, 1)])
    block_bytes = source[0].nbytes
    assert bytes(payload[:block_bytes]) == source[7].cpu().view(torch.uint8).numpy().tobytes()
    assert bytes(payload[block_bytes:2 * block_bytes]) == tier[3].view(torch.uint8).numpy().tobytes()
    target = torch.zeros_like(source)
    write_blocks(target, payload.tobytes(), [(0, 5), (2, 6)])
    assert torch.equal(target[5:7], source[[7, 9]])  # read on the same stream, after the write
