"""What every kernel launcher shares: argument checks and the CPU fallback to Triton's interpreter.

A kernel runs compiled on a CUDA device. On any other device it runs through Triton's
interpreter (numpy, slow, exact in float32): that is how the CPU tests check the very same
kernel source. `TRITON_INTERPRET=1` makes `@triton.jit` build interpreted kernels from the
start; without it, `for_device` wraps the kernel's Python function on first CPU use, so the
result does not depend on which module happened to import the kernels first.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from spillway.kernels.fp8 import FP8_E4M3

_interpreted: dict[int, object] = {}


def _interpreted_twin(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    twin = _interpreted.get(id(kernel))
    if twin is None:
        twin = _interpreted[id(kernel)] = InterpretedFunction(kernel.fn)
    return twin


@contextlib.contextmanager
def _library_calls_interpreted():
    """Let an interpreted kernel call triton.language's own jit helpers (tl.sum, tl.cdiv, ...).

    They are interpreted already when TRITON_INTERPRET=1 was set before triton was imported;
    otherwise they are compiled-only JITFunctions, so calls to them go through interpreted
    twins for the duration of one CPU launch.
    """
    if not isinstance(tl.sum, JITFunction):
        yield
        return
    original = JITFunction.__call__
    JITFunction.__call__ = lambda self, *args, **kwargs: _interpreted_twin(self)(*args, **kwargs)
    try:
        yield
    finally:
        JITFunction.__call__ = original


_MISSING = object()


def _language_objects() -> list[object]:
    modules = [tl, tl.core, tl.math, tl.standard]
    return modules + [value for value in vars(tl.core).values() if isinstance(value, type)]


@contextlib.contextmanager
def _language_restored():
    """Undo whatever the interpreter patched into triton.language during one launch.

    The interpreter rebinds triton.language's builtins and tensor methods to numpy versions
    and does not always undo it (never in Triton 3.6, not for nested library calls in 3.9);
    left in place, they break every later compilation in the process.
    """
    saved = [(obj, dict(vars(obj))) for obj in _language_objects()]
    try:
        yield
    finally:
        for obj, before in saved:
            after = vars(obj)
            if isinstance(obj, type):
                # New module globals are the interpreter's own names, which its cached
                # rewrites of library functions need; new class attributes are patches.
                for name in [name for name in after if name not in before]:
                    delattr(obj, name)
            for name, value in before.items():
                if after.get(name, _MISSING) is not value:
                    setattr(obj, name, value)


class _CpuLaunch:
    def __init__(self, kernel) -> None:
        self.kernel = _interpreted_twin(kernel)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _language_restored(), _library_calls_interpreted():
                return self.kernel[grid](*args, PDL=False, **kwargs)

        return launch


# Programmatic dependent launch (Hopper and newer): a kernel is launched while the one before it
# on the stream still runs, and waits on the device (`wait_for_inputs`) before it touches memory.
# It hides most of the ~1 us between two small kernels; a decode step runs about 250 of them.
_programmatic_launch = True


def use_programmatic_launch(enabled: bool) -> None:
    """Turn programmatic dependent launch of the kernels on or off (on by default where the
    device and Triton support it); the worker sets it from SPILLWAY_PDL."""
    global _programmatic_launch
    _programmatic_launch = bool(enabled)


@functools.cache
def _supports_programmatic_launch(device_index: int) -> bool:
    triton_version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and triton_version >= (3, 3)


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels launched on `device` now use programmatic dependent launch."""
    if device.type != "cuda" or not _programmatic_launch:
        return False
    return _supports_programmatic_launch(torch.cuda.current_device() if device.index is None else device.index)


class _CudaLaunch:
    def __init__(self, kernel, pdl: bool) -> None:
        self.kernel = kernel
        self.pdl = pdl

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self.kernel[grid](*args, PDL=self.pdl, launch_pdl=self.pdl, **kwargs)

        return launch


def for_device(kernel, device: torch.device):
    """A launcher of `kernel` on `device`: compiled on a CUDA device (with programmatic
    dependent launch where supported), interpreted elsewhere. Every kernel takes a last
    constexpr parameter `PDL` and starts with `wait_for_inputs(PDL)`; the launcher sets it."""
    if device.type == "cuda":
        return _CudaLaunch(kernel, programmatic_launch(device))
    return _CpuLaunch(kernel)


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the kernels before this one have finished
    and their writes are visible, then let the next kernel launch. A kernel calls it before it
    reads or writes global memory."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def check(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless `condition`: launchers report bad arguments, never assert."""
    if not condition:
        raise ValueError(message)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int | tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    last_dim_contiguous: bool = True,
) -> None:
    """Type, rank, dtype, device and unit stride of the last dim, with a message naming `name`."""
    check(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    ranks = " or ".join(map(str, ndims))
    check(tensor.dim() in ndims, f"{name} must have {ranks} dims, got shape {tuple(tensor.shape)}")
    check(tensor.dtype in dtypes, f"{name} must be one of {[str(d) for d in dtypes]}, got {tensor.dtype}")
    check(tensor.device == device, f"{name} is on {tensor.device}, expected {device}")
    if last_dim_contiguous and tensor.dim() > 0 and tensor.shape[-1] > 1:
        check(tensor.stride(-1) == 1, f"{name} needs a contiguous last dim, got strides {tensor.stride()}")


def stride_of(tensor: torch.Tensor | None, dim: int) -> int:
    """`tensor.stride(dim)`, 0 for an optional tensor left out (its pointer None, never read)."""
    return 0 if tensor is None else tensor.stride(dim)


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (8 stands in for the CPU): what split counts fill."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def check_cache(kv_cache: torch.Tensor, layer: int) -> None:
    """The paged KV cache `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]` the
    attention kernels read: contiguous, block size 8..128 and head_dim 16..256, powers of two."""
    check_tensor("kv_cache", kv_cache, ndim=6, dtypes=KV_CACHE_DTYPES, device=kv_cache.device)
    check(kv_cache.is_contiguous(), "kv_cache must be contiguous")
    _, num_layers, two, block_size, _, head_dim = kv_cache.shape
    check(two == 2, f"kv_cache dim 2 must be 2 (k, v), got shape {tuple(kv_cache.shape)}")
    check(0 <= layer < num_layers, f"layer {layer} out of range for {num_layers} layers")
    check(is_power_of_two(block_size) and 8 <= block_size <= 128,
          f"block_size must be a power of two in 8..128, got {block_size}")
    check(is_power_of_two(head_dim) and 16 <= head_dim <= 256,
          f"head_dim must be a power of two in 16..256, got {head_dim}")


def dtypes_for_cache(cache_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The q/k/v dtypes that work with a KV cache of `cache_dtype`: its own, or any float
    dtype for a float8 e4m3 cache (kernels/fp8.py)."""
    return FLOAT_DTYPES if cache_dtype == FP8_E4M3 else (cache_dtype,)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_CACHE_DTYPES = (*FLOAT_DTYPES, FP8_E4M3)
INDEX_DTYPES = (torch.int32, torch.int64)

next_power_of_2 = triton.next_power_of_2
