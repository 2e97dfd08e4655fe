"""Host launchers: validate inputs, build or reuse the segment table, size the grid, launch.

Triton is imported on first launch, not at import time, so CPU-only users of the other copy backends never
need it. Two runtimes are supported:

* CUDA (the real one): sources are CUDA tensors of one device, destinations are pinned CPU tensors (written
  zero-copy through unified addressing) or CUDA tensors. The launch is asynchronous on the *current* stream;
  the caller synchronizes before reading results and keeps every tensor alive until then.
* The interpreter (``TRITON_INTERPRET=1`` set before triton is imported): every tensor must be a CPU tensor;
  the launch runs synchronously on the CPU. This is how CI tests the kernels.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from lazyckpt.triton_kernels._table import (ROW_WIDTH, CopySegment, TableCache, build_rows, chunk_segments,
                                            layout_key, validate_segments)

logger = logging.getLogger(__name__)

DEFAULT_NUM_PROGRAMS = 16
"""Persistent grid size K: bounds how many SMs a copy takes from training (provisional, see docs/triton.md)."""
DEFAULT_BLOCK_BYTES = 8192
"""Bytes each program moves per loop iteration."""
DEFAULT_NUM_WARPS = 4
MAX_NUM_PROGRAMS = 1024
_MASK64 = (1 << 64) - 1
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 2
_NO_RUNTIME = (
    "lazyckpt.triton_kernels needs a CUDA device (torch.cuda.is_available() is False here) or the Triton "
    "interpreter: set TRITON_INTERPRET=1 before triton is imported to run the kernels on CPU tensors, or use "
    "copy_backend='cpu'"
)


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (it is an optional dependency)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken install, or sys.modules["triton"] = None (blocked)
        return False


def _kernels() -> ModuleType:
    if not triton_available():
        raise ImportError(
            "lazyckpt.triton_kernels needs the optional 'triton' package: pip install 'lazyckpt[triton]' "
            "(or use copy_backend='cpu' or 'cuda')"
        )
    return importlib.import_module("lazyckpt.triton_kernels._kernels")


def interpreter_active() -> bool:
    """Whether the kernels run (or, once imported, will run) in the Triton interpreter on CPU tensors."""
    module = _kernels_if_loaded()
    if module is not None:
        return module.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "on", "yes"}


def _kernels_if_loaded() -> ModuleType | None:
    import sys

    return sys.modules.get("lazyckpt.triton_kernels._kernels")


def require_runtime() -> None:
    """Raise a clear error unless triton is installed and either CUDA or the interpreter is available.

    Raises:
        ImportError: triton is not installed.
        RuntimeError: no CUDA device and ``TRITON_INTERPRET`` is not set.
    """
    _kernels()
    if not interpreter_active() and not torch.cuda.is_available():
        raise RuntimeError(_NO_RUNTIME)


def check_launch_options(num_programs: int, block_bytes: int, num_warps: int) -> None:
    """Raise ValueError naming the first launch option out of range."""
    if not isinstance(num_programs, int) or not 1 <= num_programs <= MAX_NUM_PROGRAMS:
        raise ValueError(f"num_programs={num_programs!r} must be an int in [1, {MAX_NUM_PROGRAMS}]")
    if not isinstance(block_bytes, int) or block_bytes < 64 or block_bytes > 65536 or block_bytes & (block_bytes - 1):
        raise ValueError(f"block_bytes={block_bytes!r} must be a power of two in [64, 65536]")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps={num_warps!r} must be a power of two in [1, 32]")


def _check_byte_buffer(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.uint8:
        raise ValueError(
            f"{name}.dtype={tensor.dtype} must be torch.uint8; pass a flat byte view such as "
            "t.contiguous().view(-1).view(torch.uint8)"
        )
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} and strides {tuple(tensor.stride())}; it must be 1-D and "
            "contiguous (use .contiguous().view(-1))"
        )
    return tensor


def _resolve_device(sources: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], interpreted: bool) -> torch.device:
    """The device the launch runs on, after checking every tensor can be reached from it."""
    named = [(f"sources[{i}]", t) for i, t in enumerate(sources)] + [(f"dsts[{i}]", t) for i, t in enumerate(dsts)]
    for name, tensor in named:
        _check_byte_buffer(name, tensor)
    if interpreted:
        for name, tensor in named:
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"{name} is on {tensor.device}, but TRITON_INTERPRET=1 runs the kernels on the CPU: every "
                    "tensor must be a CPU tensor (unset TRITON_INTERPRET to run on the GPU)"
                )
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(_NO_RUNTIME)
    return _cuda_device(sources, dsts)


def _cuda_device(sources: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> torch.device:
    device = next((t.device for t in sources if t.is_cuda), None) or next((t.device for t in dsts if t.is_cuda), None)
    device = device or torch.device("cuda", torch.cuda.current_device())
    for i, tensor in enumerate(sources):
        if tensor.device != device:
            raise ValueError(
                f"sources[{i}] is on {tensor.device}; every source must be on {device} (one launch per device; "
                "copy CPU tensors with Tensor.copy_, or set TRITON_INTERPRET=1 to run the kernels on the CPU)"
            )
    for i, tensor in enumerate(dsts):
        if tensor.is_cuda and tensor.device != device:
            raise ValueError(f"dsts[{i}] is on {tensor.device}; device destinations must be on {device}")
        if tensor.device.type == "cpu" and tensor.numel() and not tensor.is_pinned():
            raise ValueError(
                f"dsts[{i}] is pageable CPU memory; the kernel writes host memory through unified addressing, "
                "so allocate it pinned: torch.empty(n, dtype=torch.uint8, pin_memory=True)"
            )
    return device


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    lib.cuPointerGetAttribute.restype = ctypes.c_int
    return lib


def _device_address(tensor: torch.Tensor, device: torch.device) -> int:
    """The address a kernel running on ``device`` must use for ``tensor``'s first byte.

    Pinned memory from ``cudaHostAlloc`` has the same address on host and device, but memory pinned with
    ``cudaHostRegister`` (``pinned_use_cuda_host_register``) may have a different device alias, so ask the
    driver; table addresses bypass the launcher's own pointer translation. The interpreter (``device`` is
    the CPU) dereferences host addresses.
    """
    address = tensor.data_ptr()
    if device.type != "cuda" or tensor.is_cuda or tensor.numel() == 0:
        return address
    lib = _libcuda()
    if lib is None:
        return address
    out = ctypes.c_uint64()
    rc = lib.cuPointerGetAttribute(ctypes.byref(out), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER, address)
    if rc != 0:
        logger.debug("cuPointerGetAttribute failed (%d) for a pinned buffer; using its host address", rc)
        return address
    return out.value


def _table_for(
    device: torch.device,
    sources: Sequence[torch.Tensor],
    dst_sizes: Sequence[int] | None,
    segments: Sequence[CopySegment],
    cache: TableCache | None,
) -> torch.Tensor:
    """The device-resident table for this layout: from ``cache`` if seen before, else validated and built."""
    src_spans = [(_device_address(t, device), t.numel()) for t in sources]
    key = layout_key(device, src_spans, dst_sizes, segments)
    table = cache.get(key) if cache is not None else None
    if table is not None:
        return table
    validate_segments(segments, [n for _, n in src_spans], dst_sizes)
    rows = build_rows(segments, [a for a, _ in src_spans])
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, ROW_WIDTH).to(device)
    if cache is not None:
        cache.put(key, table)
    return table


def _dst_addresses(dsts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The per-launch vector of destination base addresses, on the launch's device."""
    addrs = torch.tensor([_device_address(t, device) for t in dsts] or [0], dtype=torch.int64)
    if device.type != "cuda":
        return addrs
    # Pinned staging, then an async copy on the current stream: no host sync per launch.
    return addrs.pin_memory().to(device, non_blocking=True)


def _launch(
    kernel: object,
    args: tuple[torch.Tensor, ...],
    device: torch.device,
    num_programs: int,
    block_bytes: int,
    num_warps: int,
) -> torch.Tensor:
    table = args[0]
    n = table.shape[0]
    # Checksums land in host memory: pinned (written zero-copy) on CUDA, plain under the interpreter.
    sums = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
    if n == 0:
        return sums
    grid = (min(num_programs, n),)
    if device.type != "cuda":
        kernel[grid](table, ROW_WIDTH, n, *args[1:], sums, BLOCK_BYTES=block_bytes)
        return sums
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        # Cached tables may come from another stream; keep every device input alive until this launch is done.
        for tensor in args:
            tensor.record_stream(stream)
        kernel[grid](table, ROW_WIDTH, n, *args[1:], sums, BLOCK_BYTES=block_bytes, num_warps=num_warps)
    return sums


def copy_with_checksums(
    sources: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    segments: Sequence[CopySegment],
    *,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    num_warps: int = DEFAULT_NUM_WARPS,
    cache: TableCache | None = None,
) -> torch.Tensor:
    """Copy every segment from its source to its destination in one launch, with fused checksums.

    On CUDA the launch is queued on the current stream and returns at once: synchronize that stream (or an
    event recorded after this call) before reading ``dsts`` or the result, and keep every tensor alive until
    then. Under the interpreter it runs to completion before returning.

    Args:
        sources: Flat contiguous ``uint8`` tensors to read (CUDA tensors of one device; CPU when interpreted).
        dsts: Flat contiguous ``uint8`` buffers to write (pinned CPU or CUDA; CPU when interpreted).
        segments: What to copy; each at most one checksum chunk, destinations must not overlap.
        num_programs: Persistent grid size K (the launch uses ``min(K, len(segments))`` programs).
        block_bytes: Bytes per program per loop iteration (a power of two).
        num_warps: Warps per program (ignored by the interpreter).
        cache: Reuses the device table of a layout seen before (same sources, same segments, same destination
            sizes; destination addresses may differ).

    Returns:
        An int64 host tensor: element ``i`` holds the bit pattern of segment ``i``'s unsigned 64-bit
        ``lzc64-v1`` checksum (see :func:`checksums_to_list`).

    Raises:
        ImportError: triton is not installed.
        RuntimeError: neither CUDA nor the interpreter is available.
        TypeError, ValueError: a bad argument; the message names it and the fix.

    Example:
        >>> src = torch.arange(10, dtype=torch.uint8); dst = torch.zeros(10, dtype=torch.uint8)
        >>> checksums_to_list(copy_with_checksums([src], [dst], chunk_segments(10)))  # doctest: +SKIP
        [...]
    """
    check_launch_options(num_programs, block_bytes, num_warps)
    kernels = _kernels()
    device = _resolve_device(sources, dsts, kernels.INTERPRETED)
    table = _table_for(device, sources, [t.numel() for t in dsts], segments, cache)
    args = (table, _dst_addresses(dsts, device))
    return _launch(kernels.COPY_CHECKSUM_KERNEL, args, device, num_programs, block_bytes, num_warps)


def checksum_segments(
    sources: Sequence[torch.Tensor],
    segments: Sequence[CopySegment],
    *,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    num_warps: int = DEFAULT_NUM_WARPS,
    cache: TableCache | None = None,
) -> torch.Tensor:
    """Checksum every segment of ``sources`` in one launch, without copying (``dst`` fields are ignored).

    For bytes moved by the copy engines: launched on the same stream after the copies, it reads the same
    immutable sources. Same runtime rules and result as :func:`copy_with_checksums`.
    """
    check_launch_options(num_programs, block_bytes, num_warps)
    kernels = _kernels()
    device = _resolve_device(sources, [], kernels.INTERPRETED)
    table = _table_for(device, sources, None, segments, cache)
    return _launch(kernels.CHECKSUM_KERNEL, (table,), device, num_programs, block_bytes, num_warps)


def checksums_to_list(sums: torch.Tensor) -> list[int]:
    """Python ints (unsigned 64-bit) from a launcher's int64 result; read it only after the launch is done."""
    return [value & _MASK64 for value in sums.tolist()]


def copy_tensor(tensor: torch.Tensor, **launch_options: object) -> tuple[torch.Tensor, list[int]]:
    """A private contiguous CPU copy of ``tensor`` (pinned on CUDA) and its chunk checksums, synchronously.

    On CUDA the copy is ordered after the work already queued on the current stream, which it then waits
    for. ``launch_options`` go to :func:`copy_with_checksums`.

    Example:
        >>> copy, sums = copy_tensor(torch.ones(3, 5))  # doctest: +SKIP
    """
    flat = tensor.detach()
    flat = (flat if flat.is_contiguous() else flat.contiguous()).reshape(-1)
    source = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)
    nbytes = source.numel()
    out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=tensor.is_cuda)
    sums = copy_with_checksums([source], [out], chunk_segments(nbytes), **launch_options)  # type: ignore[arg-type]
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    copy = out.view(tensor.dtype) if nbytes else torch.empty(0, dtype=tensor.dtype)
    return copy.reshape(tensor.shape), checksums_to_list(sums)
