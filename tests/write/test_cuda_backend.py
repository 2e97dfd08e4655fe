"""Tests of the ``cuda`` backend and the GPU-only parts of the ``triton`` backend (stream ordering, pinned and
registered host memory, the copy-engine/kernel hybrid). They skip with a reason on machines without CUDA,
except the one that checks the error a CPU-only machine gets.
"""

from __future__ import annotations

import pytest
import torch

from lazyckpt.format.checksum import CHUNK_BYTES, checksum_bytes, tensor_bytes
from lazyckpt.format.header import TensorEntry
from lazyckpt.triton_kernels import interpreter_active, triton_available
from lazyckpt.write.plan import layout, plan_pieces
from lazyckpt.write.staging.cpu import CpuCopyBackend
from lazyckpt.write.staging.cuda import CudaCopyBackend

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")
needs_kernels = pytest.mark.skipif(
    not triton_available() or interpreter_active(),
    reason="needs triton compiling for the GPU (installed, and TRITON_INTERPRET unset)",
)


def tensors_on(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    cpu = {
        "big": torch.randn(CHUNK_BYTES // 4 * 2 + 77, generator=gen),
        "bf16": torch.randn(1001, generator=gen).to(torch.bfloat16),
        "int64": torch.arange(-50, 50, dtype=torch.int64),
        "bool": torch.rand(13, generator=gen) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "transposed": torch.randn(33, 9, generator=gen).t(),
    }
    return {k: v.to(device) for k, v in cpu.items()}


def entries_of(tensors: dict[str, torch.Tensor]) -> list[TensorEntry]:
    return [TensorEntry(k, str(t.dtype), tuple(t.shape), t.numel() * t.element_size(), lazy=True)
            for k, t in tensors.items()]


def stage(backend, tensors: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[list[int]] | None]:
    """Stage every tensor lazily the way the engine does: on_request in save(), then prepare and copy."""
    placed, _ = layout(entries_of(tensors))
    live = [tensors[e.key] for e in placed]
    backend.on_request(live)
    sources = [backend.prepare_source(t) for t in live]
    pieces = plan_pieces(placed, piece_bytes=CHUNK_BYTES)
    slots = [torch.zeros(CHUNK_BYTES, dtype=torch.uint8, pin_memory=backend.pin_memory()) for _ in pieces]
    sums = backend.copy_pieces(sources, pieces, slots)
    return [slot[: p.nbytes].clone() for p, slot in zip(pieces, slots)], sums


def assert_same_staging(backend, *, returns_checksums: bool) -> None:
    got_bytes, got_sums = stage(backend, tensors_on("cuda"))
    want_bytes, _ = stage(CpuCopyBackend(), tensors_on("cpu"))
    for got, want in zip(got_bytes, want_bytes, strict=True):
        assert torch.equal(got, want)
    if not returns_checksums:
        assert got_sums is None, "without device checksums the writer checksums the staged bytes"
        return
    pieces = plan_pieces(layout(entries_of(tensors_on("cpu")))[0], piece_bytes=CHUNK_BYTES)
    expected = [[checksum_bytes(buf[s.dst_offset : s.dst_offset + s.nbytes].numpy()) for s in piece.segments]
                for piece, buf in zip(pieces, want_bytes, strict=True)]
    assert got_sums == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_backend_without_cuda_fails_with_a_clear_error():
    with pytest.raises(RuntimeError, match="copy_backend='cuda' needs a CUDA device.*use copy_backend='cpu'"):
        CudaCopyBackend()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("device_checksum", [False, pytest.param(True, marks=needs_kernels)])
def test_cuda_backend_stages_the_same_bytes_and_checksums_as_the_cpu_backend(device_checksum):
    assert_same_staging(CudaCopyBackend(device_checksum=device_checksum), returns_checksums=device_checksum)


@pytest.mark.gpu
@requires_cuda
@needs_kernels
@pytest.mark.parametrize("ce_min_bytes", [None, 4096])
def test_triton_backend_and_its_copy_engine_hybrid_match_the_cpu_backend(ce_min_bytes):
    from lazyckpt.write.staging.triton import TritonCopyBackend

    assert_same_staging(TritonCopyBackend(num_programs=4, ce_min_bytes=ce_min_bytes), returns_checksums=True)


def _backends() -> list:
    from lazyckpt.write.staging.triton import TritonCopyBackend

    return [
        pytest.param(lambda: CudaCopyBackend(device_checksum=False), id="cuda"),
        pytest.param(lambda: CudaCopyBackend(device_checksum=True), id="cuda+device-checksum", marks=needs_kernels),
        pytest.param(lambda: TritonCopyBackend(num_programs=4), id="triton", marks=needs_kernels),
        pytest.param(lambda: TritonCopyBackend(ce_min_bytes=4096), id="triton+copy-engines", marks=needs_kernels),
    ]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("make_backend", _backends())
def test_copy_stream_waits_for_the_update_queued_before_the_request(make_backend):
    backend = make_backend()
    x = torch.zeros(CHUNK_BYTES // 4, device="cuda")
    compute = torch.cuda.Stream()
    compute.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # keeps the update pending long after the host moves on
        x.add_(1.0)  # "optimizer.step()"
        entries, _ = layout([TensorEntry("x", "F32", tuple(x.shape), x.numel() * 4, lazy=True)])
        backend.on_request([x])
    pieces = plan_pieces(entries, piece_bytes=CHUNK_BYTES)
    slots = [torch.zeros(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)]
    sums = backend.copy_pieces([backend.prepare_source(x)], pieces, slots)
    staged = slots[0].view(torch.float32)
    assert bool((staged == 1.0).all()), "the copy ran before the update it was ordered after"
    assert sums in (None, [[checksum_bytes(slots[0].numpy())]])
    x.add_(1.0)  # the next update, after the copy is done, must not reach the staged bytes
    torch.cuda.synchronize()
    assert bool((staged == 1.0).all())


@pytest.mark.gpu
@requires_cuda
@needs_kernels
def test_launcher_rejects_pageable_host_destinations():
    from lazyckpt.triton_kernels import CopySegment, copy_with_checksums

    src = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"dsts\[0\] is pageable CPU memory.*pin_memory=True"):
        copy_with_checksums([src], [torch.zeros(16, dtype=torch.uint8)], [CopySegment(0, 0, 16)])
    with pytest.raises(ValueError, match=r"sources\[0\] is on cpu"):
        copy_with_checksums([src.cpu()], [src.clone()], [CopySegment(0, 0, 16)])


@pytest.mark.gpu
@requires_cuda
@needs_kernels
def test_kernel_writes_host_memory_registered_with_cuda_host_register():
    from lazyckpt.triton_kernels import checksums_to_list, chunk_segments, copy_with_checksums

    data = torch.randint(0, 256, (10_007,), dtype=torch.uint8)
    host = torch.zeros(16_384, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)) == 0
    try:
        sums = copy_with_checksums([data.cuda()], [host[16:]], chunk_segments(data.numel()), num_programs=2)
        torch.cuda.synchronize()
        assert torch.equal(host[16 : 16 + data.numel()], data)
        assert checksums_to_list(sums) == [checksum_bytes(data.numpy())]
        assert bool((host[:16] == 0).all()) and bool((host[16 + data.numel() :] == 0).all())
    finally:
        cudart.cudaHostUnregister(host.data_ptr())


@pytest.mark.gpu
@requires_cuda
@needs_kernels
def test_triton_copy_eager_of_a_cuda_tensor_is_an_exact_cpu_copy():
    from lazyckpt.write.staging.triton import TritonCopyBackend

    for tensor in tensors_on("cuda").values():
        copy = TritonCopyBackend(num_programs=2).copy_eager(tensor)
        assert copy.device.type == "cpu" and copy.shape == tensor.shape and copy.dtype == tensor.dtype
        assert bytes(tensor_bytes(copy)) == bytes(tensor_bytes(tensor.cpu().contiguous()))
