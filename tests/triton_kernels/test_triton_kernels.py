"""Tests of lazyckpt.triton_kernels and the ``triton`` copy backend.

Without CUDA they run the real kernels in the Triton interpreter on CPU tensors (``TRITON_INTERPRET=1`` is set
below, before anything imports the kernels); with CUDA the same tests run on the GPU with pinned destinations.
Sizes stay small: the interpreter costs ~1.5 ms per program.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from lazyckpt.format.checksum import CHUNK_BYTES, checksum_bytes, tensor_bytes  # noqa: E402
from lazyckpt.write.plan import PIECE_BYTES, layout, plan_pieces  # noqa: E402
from lazyckpt.format.header import TensorEntry  # noqa: E402
from lazyckpt.write.staging.cpu import CpuCopyBackend  # noqa: E402
from lazyckpt.write.staging.triton import TritonCopyBackend  # noqa: E402
from lazyckpt.triton_kernels import (CopySegment, TableCache, checksum_segments, checksums_to_list, chunk_segments,
                                     copy_tensor, copy_with_checksums, interpreter_active, require_runtime)

INTERPRETED = interpreter_active()
DEVICE = torch.device("cpu") if INTERPRETED else torch.device("cuda")
CANARY = 0xA5
PAD = 64


def mixed_tensors() -> dict[str, torch.Tensor]:
    """One of each dtype the issue names, with odd lengths, empty, 0-d and a non-contiguous view."""
    gen = torch.Generator().manual_seed(0)
    return {
        "fp32_odd": torch.randn(1031, generator=gen),
        "bf16": torch.randn(37, generator=gen).to(torch.bfloat16),
        "fp16_2d": torch.randn(3, 5, generator=gen).to(torch.float16),
        "fp64": torch.randn(9, generator=gen, dtype=torch.float64),
        "int64": torch.randint(-(2**62), 2**62, (17,), generator=gen, dtype=torch.int64),
        "uint8": torch.randint(0, 256, (1001,), generator=gen, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (13,), generator=gen).bool(),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.25),
        "transposed": torch.randn(6, 7, generator=gen).t(),
    }


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat contiguous uint8 copy of ``tensor``'s bytes (the reference)."""
    return torch.from_numpy(tensor_bytes(tensor.contiguous()).copy())


def source(tensor: torch.Tensor) -> torch.Tensor:
    """The launcher's view of ``tensor``: flat contiguous bytes on the test device."""
    return as_bytes(tensor).to(DEVICE)


def canaried(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A destination of ``nbytes`` bytes with ``PAD`` canary bytes on each side: (whole buffer, inner view)."""
    whole = torch.full((nbytes + 2 * PAD,), CANARY, dtype=torch.uint8, pin_memory=DEVICE.type == "cuda")
    return whole, whole[PAD : PAD + nbytes]


def assert_canaries(whole: torch.Tensor) -> None:
    assert bool((whole[:PAD] == CANARY).all()), "bytes before the destination were overwritten"
    assert bool((whole[-PAD:] == CANARY).all()), "bytes after the destination were overwritten"


def run_copy(sources, dsts, segments, **options) -> list[int]:
    sums = copy_with_checksums(sources, dsts, segments, **options)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return checksums_to_list(sums)


def pack(sizes: list[int], align: int) -> tuple[list[CopySegment], int]:
    """Chunk segments for sources of ``sizes`` placed back to back in one destination, each start aligned."""
    segments, offset = [], 0
    for index, size in enumerate(sizes):
        segments += chunk_segments(size, src=index, dst_offset=offset)
        offset += size + (-size % align)
    return segments, offset


@pytest.mark.parametrize("align", [1, 16], ids=["packed-unaligned", "16-byte-aligned"])
def test_copy_of_mixed_dtypes_is_bit_exact_with_reference_checksums(align):
    tensors = mixed_tensors()
    refs = [as_bytes(t) for t in tensors.values()]
    segments, total = pack([r.numel() for r in refs], align)
    whole, dst = canaried(total)
    sums = run_copy([r.to(DEVICE) for r in refs], [dst], segments, num_programs=4)
    for seg, value in zip(segments, sums):
        expected = refs[seg.src][seg.src_offset : seg.src_offset + seg.nbytes]
        assert torch.equal(dst[seg.dst_offset : seg.dst_offset + seg.nbytes].cpu(), expected), list(tensors)[seg.src]
        assert value == checksum_bytes(expected.numpy()), list(tensors)[seg.src]
    assert_canaries(whole)


@pytest.mark.parametrize("src_shift", [0, 1, 8, 16])
@pytest.mark.parametrize("nbytes", [1, 7, 8, 9, 4096 + 24, 3 * 8192 + 5])
def test_word_and_byte_paths_give_the_same_bytes_and_checksums(src_shift, nbytes):
    # Shift 0/16 takes the aligned uint64 path (dst is 16-aligned), 1/8 the byte path; all must agree.
    gen = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes + 32,), generator=gen, dtype=torch.uint8)
    src = data.to(DEVICE)[src_shift : src_shift + nbytes]
    whole, dst = canaried(nbytes)
    (value,) = run_copy([src], [dst], [CopySegment(0, 0, nbytes)], block_bytes=8192)
    assert torch.equal(dst.cpu(), src.cpu())
    assert value == checksum_bytes(src.cpu().numpy())
    assert_canaries(whole)


def test_checksums_restart_at_every_segment_and_match_the_checksum_kernel():
    data = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    segments = chunk_segments(1000, chunk_bytes=96)
    whole, dst = canaried(1000)
    copied = run_copy([data.to(DEVICE)], [dst], segments, num_programs=3, block_bytes=64)
    only = checksum_segments([data.to(DEVICE)], segments, num_programs=2, block_bytes=64)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    expected = [checksum_bytes(data[s.src_offset : s.src_offset + s.nbytes].numpy()) for s in segments]
    assert copied == expected
    assert checksums_to_list(only) == expected
    assert torch.equal(dst.cpu(), data)
    assert_canaries(whole)


def test_a_full_chunk_and_a_tail_chunk_copy_exactly():
    data = torch.randint(0, 256, (CHUNK_BYTES + 24,), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    whole, dst = canaried(data.numel())
    sums = run_copy([data.to(DEVICE)], [dst], chunk_segments(data.numel()), num_programs=2)
    assert torch.equal(dst.cpu(), data)
    assert sums == [checksum_bytes(data[:CHUNK_BYTES].numpy()), checksum_bytes(data[CHUNK_BYTES:].numpy())]
    assert_canaries(whole)


@pytest.mark.parametrize("num_programs", [1, 3, 64])
def test_grid_size_does_not_change_the_result(num_programs):
    refs = [as_bytes(t) for t in mixed_tensors().values()]
    segments, total = pack([r.numel() for r in refs], 16)
    _, dst = canaried(total)
    sums = run_copy([r.to(DEVICE) for r in refs], [dst], segments, num_programs=num_programs)
    assert sums == [checksum_bytes(refs[s.src][s.src_offset : s.src_offset + s.nbytes].numpy()) for s in segments]


def test_checksum_changes_when_one_bit_flips_or_two_words_swap():
    data = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    flipped = data.clone()
    flipped[77] ^= 0x10
    swapped = data.clone()
    swapped[8:16], swapped[40:48] = data[40:48].clone(), data[8:16].clone()
    variants = [data, flipped, swapped]
    segments = [CopySegment(i, 0, 256) for i in range(3)]
    result = checksum_segments([v.to(DEVICE) for v in variants], segments)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    sums = checksums_to_list(result)
    assert sums == [checksum_bytes(v.numpy()) for v in variants]
    assert len(set(sums)) == 3


def test_empty_and_zero_length_segments_checksum_to_the_reference():
    whole, dst = canaried(8)
    empty = torch.empty(0, dtype=torch.uint8, device=DEVICE)
    assert run_copy([empty], [dst], [CopySegment(0, 0, 0)]) == [checksum_bytes(empty.cpu().numpy())]
    assert run_copy([empty], [dst], []) == []
    assert_canaries(whole)


def test_a_cached_table_serves_new_destinations_of_the_same_layout():
    refs = [as_bytes(t) for t in mixed_tensors().values()]
    sources = [r.to(DEVICE) for r in refs]
    segments, total = pack([r.numel() for r in refs], 1)
    cache = TableCache(max_entries=2)
    first_whole, first = canaried(total)
    second_whole, second = canaried(total)
    assert run_copy(sources, [first], segments, cache=cache) == run_copy(sources, [second], segments, cache=cache)
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)
    assert torch.equal(first.cpu(), second.cpu())
    assert_canaries(first_whole)
    assert_canaries(second_whole)


@pytest.mark.parametrize("name", list(mixed_tensors()))
def test_copy_tensor_returns_a_private_contiguous_cpu_copy(name):
    tensor = mixed_tensors()[name].to(DEVICE)
    copy, sums = copy_tensor(tensor, num_programs=2)
    assert copy.device.type == "cpu" and copy.dtype == tensor.dtype and copy.shape == tensor.shape
    assert copy.is_contiguous()
    assert torch.equal(as_bytes(copy), as_bytes(tensor.cpu()))
    reference = as_bytes(tensor.cpu()).numpy()
    assert sums == [checksum_bytes(reference[i : i + CHUNK_BYTES]) for i in range(0, reference.size, CHUNK_BYTES)]
    if tensor.numel() and tensor.device.type == "cpu":
        assert copy.data_ptr() != tensor.data_ptr()


def _bad_inputs() -> list:
    good = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    dst = canaried(16)[1]
    seg = CopySegment(0, 0, 16)
    return [
        ([good.float()], [dst], [seg], {}, ValueError, r"sources\[0\]\.dtype=torch\.float32 must be torch\.uint8"),
        ([good.view(4, 4)], [dst], [seg], {}, ValueError, r"sources\[0\] has shape \(4, 4\).*1-D and contiguous"),
        ([good[::2]], [dst], [CopySegment(0, 0, 8)], {}, ValueError, r"sources\[0\].*1-D and contiguous"),
        (["bytes"], [dst], [seg], {}, TypeError, r"sources\[0\] must be a torch\.Tensor, got str"),
        ([torch.empty(16, dtype=torch.uint8, device="meta")], [dst], [seg], {}, ValueError, r"sources\[0\] is on meta"),
        ([good], [dst], [CopySegment(0, 8, 16)], {}, ValueError, r"past the end of sources\[0\] \(16 bytes\)"),
        ([good], [dst], [CopySegment(0, 0, 16, 0, 4)], {}, ValueError, r"past the end of dsts\[0\] \(16 bytes\)"),
        ([good], [dst], [CopySegment(0, 0, 8), CopySegment(0, 8, 8, 0, 4)], {}, ValueError, r"overlapping.*dsts\[0\]"),
        ([good], [dst], [CopySegment(1, 0, 8)], {}, ValueError, r"src index out of range for 1 sources"),
        ([good], [dst], [CopySegment(0, -1, 8)], {}, ValueError, r"nbytes and offsets must be >= 0"),
        ([good], [dst], [CopySegment(0, 0, CHUNK_BYTES + 1)], {}, ValueError, r"exceeds one checksum chunk"),
        ([good], [dst], [seg], {"num_programs": 0}, ValueError, r"num_programs=0 must be an int in \[1, 1024\]"),
        ([good], [dst], [seg], {"block_bytes": 100}, ValueError, r"block_bytes=100 must be a power of two"),
        ([good], [dst], [seg], {"num_warps": 3}, ValueError, r"num_warps=3 must be a power of two"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_launcher_rejects_bad_input_with_a_message_naming_it(case):
    sources, dsts, segments, options, error, message = _bad_inputs()[case]
    with pytest.raises(error, match=message):
        copy_with_checksums(sources, dsts, segments, **options)


def test_checksum_launcher_validates_like_the_copy_launcher():
    with pytest.raises(ValueError, match=r"past the end of sources\[0\]"):
        checksum_segments([torch.zeros(4, dtype=torch.uint8, device=DEVICE)], [CopySegment(0, 0, 5)])


def test_without_cuda_or_interpreter_the_error_says_how_to_fix_it(monkeypatch):
    from lazyckpt.triton_kernels import _kernels

    monkeypatch.setattr(_kernels, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device.*TRITON_INTERPRET=1"):
        require_runtime()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonCopyBackend()
    data = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        copy_with_checksums([data], [data.clone()], [CopySegment(0, 0, 8)])


def test_import_works_without_triton_and_use_fails_clearly():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # as if triton were not installed
        import lazyckpt.triton_kernels, lazyckpt.write.staging.cuda, lazyckpt.write.staging.triton
        from lazyckpt.write.staging.triton import TritonCopyBackend
        try:
            TritonCopyBackend()
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "ImportError: lazyckpt.triton_kernels needs the optional 'triton' package" in out.stdout
    assert "pip install 'lazyckpt[triton]'" in out.stdout


def test_kernels_run_in_the_interpreter_even_when_triton_was_imported_first():
    # In a test session another module (lightning, torch) may import triton before TRITON_INTERPRET is set.
    script = textwrap.dedent(
        """
        import os, triton, torch
        os.environ["TRITON_INTERPRET"] = "1"
        from lazyckpt.format.checksum import checksum_bytes
        from lazyckpt.triton_kernels import checksums_to_list, chunk_segments, copy_with_checksums
        src = torch.arange(100, dtype=torch.uint8)
        dst = torch.zeros(100, dtype=torch.uint8)
        sums = checksums_to_list(copy_with_checksums([src[1:]], [dst], chunk_segments(99)))
        assert torch.equal(dst[:99], src[1:]) and sums == [checksum_bytes(src[1:].numpy())]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def make_job(tensors: dict[str, torch.Tensor], eager: set[str] = frozenset()):
    """Entries, pieces and flat sources the way the engine's copier builds them (eager sources are None)."""
    entries = [
        TensorEntry(k, str(t.dtype), tuple(t.shape), t.numel() * t.element_size(), lazy=k not in eager)
        for k, t in tensors.items()
    ]
    placed, _ = layout(entries)
    by_key = {k: t.to(DEVICE) for k, t in tensors.items()}
    # Pieces of one chunk each, so every test stages several pieces.
    return placed, plan_pieces(placed, piece_bytes=CHUNK_BYTES), [by_key[e.key] if e.lazy else None for e in placed]


def stage(backend, placed, pieces, tensors, lazy_only=True):
    """Stage the lazy pieces through ``backend``: (staged bytes per piece, returned checksums or None)."""
    backend.on_request([t for t in tensors if t is not None])
    sources = [backend.prepare_source(t) if t is not None else None for t in tensors]
    pieces = [p for p in pieces if p.lazy] if lazy_only else pieces
    slots = [torch.zeros(PIECE_BYTES, dtype=torch.uint8, pin_memory=backend.pin_memory()) for _ in pieces]
    sums = backend.copy_pieces(sources, pieces, slots)
    return [slot[: p.nbytes].clone() for p, slot in zip(pieces, slots)], sums


def staged_checksums(pieces, staged) -> list[list[int]]:
    """What the writer computes when a backend returns no checksums."""
    return [
        [checksum_bytes(buf[s.dst_offset : s.dst_offset + s.nbytes].numpy()) for s in piece.segments]
        for piece, buf in zip(pieces, staged)
    ]


def test_backend_stages_the_same_bytes_and_checksums_as_the_cpu_backend():
    tensors = mixed_tensors() | {
        "big_fp32": torch.randn(CHUNK_BYTES // 4 + 50, generator=torch.Generator().manual_seed(4)),
        "eager_buf": torch.arange(5.0),
    }
    placed, pieces, sources = make_job(tensors, eager={"eager_buf"})
    backend = TritonCopyBackend(num_programs=4)
    got_bytes, got_sums = stage(backend, placed, pieces, sources)
    cpu_sources = [t.cpu() if t is not None else None for t in sources]
    want_bytes, _ = stage(CpuCopyBackend(), placed, pieces, cpu_sources)
    assert got_sums is not None, "the fused kernel's checksums must be returned"
    assert got_sums == staged_checksums([p for p in pieces if p.lazy], want_bytes)
    assert len(got_bytes) == len(want_bytes) >= 2
    for got, want in zip(got_bytes, want_bytes):
        assert torch.equal(got, want)


def test_backend_reuses_its_tables_across_checkpoints_of_the_same_layout():
    # Contiguous sources keep their addresses (a non-contiguous one gets a fresh .contiguous() copy each time).
    tensors = {k: t for k, t in mixed_tensors().items() if t.is_contiguous()}
    placed, pieces, sources = make_job(tensors)
    backend = TritonCopyBackend(num_programs=2)
    first = stage(backend, placed, pieces, sources)
    second = stage(backend, placed, pieces, sources)  # fresh slots: new destination addresses
    assert first[1] == second[1]
    assert (backend._tables.misses, backend._tables.hits) == (1, 1)


@pytest.mark.parametrize("name", ["bf16", "bool", "scalar", "empty", "transposed"])
def test_backend_copy_eager_is_a_private_exact_copy(name):
    tensor = mixed_tensors()[name].to(DEVICE)
    copy = TritonCopyBackend(num_programs=2).copy_eager(tensor)
    assert copy.device.type == "cpu" and copy.dtype == tensor.dtype and copy.shape == tensor.shape
    assert torch.equal(as_bytes(copy), as_bytes(tensor.cpu()))


def test_backend_rejects_bad_launch_options():
    with pytest.raises(ValueError, match=r"num_programs=0"):
        TritonCopyBackend(num_programs=0)
    with pytest.raises(ValueError, match=r"ce_min_bytes=0 must be positive"):
        TritonCopyBackend(ce_min_bytes=0)


_COMPILE_SCRIPT = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lazyckpt.triton_kernels import _kernels as k
sig = {"table_ptr": "*i64", "stride_row": "i32", "n_segments": "i32", "dst_addrs_ptr": "*i64",
       "sums_ptr": "*i64", "BLOCK_BYTES": "constexpr"}
src = ASTSource(fn=k.COPY_CHECKSUM_KERNEL, signature=sig, constexprs={"BLOCK_BYTES": 8192})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(json.dumps(sorted(set(re.findall(r"(?:ld|st)\\.global\\S*?\\.v2\\.b64", ptx)))))
"""


def test_copy_kernel_compiles_for_sm90_with_16_byte_vector_accesses():
    # The interpreter cannot see compile errors or vector widths; compiling needs no GPU.
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    vector_ops = out.stdout.strip().splitlines()[-1]
    assert "st.global.v2.b64" in vector_ops and "ld.global" in vector_ops, vector_ops
