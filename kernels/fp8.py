"""A float8 e4m3 KV cache: what happens to a key or value on its way into it and out of it.

A cache of dtype torch.float8_e4m3fn (Triton's float8e4nv) holds each key and value in one
byte, unscaled: a scale of 1.0, as vLLM's `--kv-cache-dtype fp8` without calibrated scales.

    in  (kv_write.py, qkv_prepare.py):  clamp to the finite range +-448, round to nearest even;
                                        NaN is stored as 0
    out (paged_attention_*.py):         convert to q's dtype (float16 for a bfloat16 q), exactly

e4m3fn has no infinity: a plain cast of anything beyond 448 gives NaN, hence the clamp.
A cache of any other dtype stores q/k/v's own dtype unchanged.

So a float8 cache never holds NaN: the pool starts zeroed (worker/runner/model_runner.py) and every
write is finite. The attention kernels rely on it: the slots past a context in its last block
(stale values of an earlier request, or zeros) are read with the block and weighted by 0,
never zeroed first; a NaN there would turn 0 * NaN into NaN. (A request whose keys or values
are NaN has NaN hidden states already; storing them as 0 keeps its blocks from poisoning the
next request they are given to.)

The kernels round in float32 arithmetic (`round_to_e4m3`) before they cast, so the cast itself
is exact. Triton's interpreter, which runs the CPU tests, rounds float32 -> float8 casts wrongly
(a carry out of the mantissa is lost; values below 2^-6 are truncated); on the GPU the hardware
conversion of an already-rounded value gives the same byte.

On the way out, a bfloat16 q is turned into float16 for the dots (`query_for_cache`): Triton
converts e4m3 to float16 in one instruction per pair, to bfloat16 only through float32.

In a float8 cache a block's values are stored transposed, `[num_kv_heads, head_dim, block_size]`
instead of `[block_size, num_kv_heads, head_dim]` (keys keep the common layout; the cache
tensor's shape does not change). The product of the attention weights with V runs over tokens,
and the matrix units take their operands token-contiguous: Triton transposes 16-bit tiles as it
loads them from shared memory, 8-bit ones only byte by byte, which made the decode kernel
instruction-bound. `value_offset` is where a value goes in either layout; `cache_values` is
the same in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

_MAX = tl.constexpr(FP8_E4M3_MAX)
# 1.5 * 2^23: (y + this) - this is y rounded to an integer, ties to even, for |y| < 2^22.
_ROUND_TO_INTEGER = tl.constexpr(12582912.0)


@triton.jit
def round_to_e4m3(x):
    """float32 `x` within +-448 rounded to nearest even on the e4m3 grid (3 mantissa bits; below
    2^-6, the subnormals, a fixed spacing of 2^-9); still float32."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    spacing_exponent = tl.maximum(exponent, -6) - 3
    spacing = ((spacing_exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse_spacing = ((127 - spacing_exponent) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(x) * inverse_spacing + _ROUND_TO_INTEGER - _ROUND_TO_INTEGER
    # The magnitude is rounded, then x's sign bit put back as a bit (a negation, compiled as
    # 0 - y, would lose it): what rounds to zero keeps its sign, as in torch.
    magnitude = (steps * spacing).to(tl.int32, bitcast=True)
    return (magnitude | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def to_cache_dtype(x, cache_ptr):
    """`x` as the cache at `cache_ptr` stores it: cast to its dtype; when that is float8 e4m3,
    NaN made 0, clamped and rounded first."""
    dtype = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:
        x = x.to(tl.float32)
        x = tl.clamp(tl.where(x == x, x, 0.0), -_MAX, _MAX)
        # Rounded already, the cast is exact; rtne all the same, should a compiler undo the rounding.
        return round_to_e4m3(x).to(dtype, fp_downcast_rounding="rtne")
    return x.to(dtype)


@triton.jit
def query_for_cache(q, cache_ptr):
    """q in the dtype the attention dots run in over the cache at `cache_ptr`: q's own, except
    a bfloat16 q over a float8 e4m3 cache, which becomes float16 (clamped to +-65504).

    Triton turns e4m3 into float16 with one hardware conversion per pair, into bfloat16 only
    through float32, which made the bfloat16 dots slower over an fp8 cache than over a bf16
    one. A bfloat16 q within +-65504 converts exactly, except magnitudes below 2^-14 (float16's
    subnormals)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        if q.dtype == tl.bfloat16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def value_offset(cache_ptr, offset, head, dim, stride_c_token, stride_c_head, BLOCK_SIZE: tl.constexpr):
    """Where the value of (token `offset` in its block, `head`, `dim`) lies within the V half
    of a block's layer: transposed per head in a float8 cache, like the keys otherwise."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return head * (stride_c_head * BLOCK_SIZE) + dim * BLOCK_SIZE + offset
    return offset * stride_c_token + head * stride_c_head + dim


def cache_values(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """The values of `layer` as a view `[num_blocks, block_size, num_kv_heads, head_dim]`,
    whatever the cache's layout (reads and writes through it reach the cache)."""
    values = kv_cache[:, layer, 1]
    if kv_cache.dtype != FP8_E4M3:  # only a float8 cache stores its values transposed
        return values
    num_blocks, block_size, num_kv_heads, head_dim = values.shape
    return values.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def convert_cache(kv_cache: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """A copy of `kv_cache` as a cache of `cache_dtype` holds it: cast like
    `to_cache_dtype_reference`, values laid out the way that dtype stores them."""
    out = torch.empty(kv_cache.shape, dtype=cache_dtype, device=kv_cache.device)
    out[:, :, 0] = to_cache_dtype_reference(kv_cache[:, :, 0], cache_dtype)
    for layer in range(kv_cache.shape[1]):
        cache_values(out, layer).copy_(to_cache_dtype_reference(cache_values(kv_cache, layer), cache_dtype))
    return out


def to_cache_dtype_reference(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`to_cache_dtype` in plain torch (whose casts round to nearest even)."""
    if cache_dtype == FP8_E4M3:
        x = x.nan_to_num(0.0, FP8_E4M3_MAX, -FP8_E4M3_MAX).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(cache_dtype)
