"""GPU measurements for the ``cuda`` and ``triton`` copy backends.

Sections (each runs in its own try/except; an error is recorded and the next section runs):

1. ``correctness``: ``save()`` right after ``optimizer.step()``, the next update issued at once (after
   ``wait_staged()``), the committed checkpoint compared bit for bit with a clone taken before that update.
2. ``bandwidth``: D2H GB/s into pinned memory, ``copy_(non_blocking=True)`` vs the Triton kernel, for large
   tensors and for ~1000 tensors under 64 KiB (aligned and unaligned packing), across grid and block sizes.
3. ``crossover``: per-tensor ``copy_`` vs one Triton launch by tensor size (sets ``AUTO_CE_MIN_BYTES``).
4. ``staging``: ``copy_pieces`` of each backend on the same pieces the engine would hand it.
5. ``interference``: slowdown of a bf16 matmul loop while each copy path runs on a side stream.
6. ``checksum``: cost of the checksum-only kernel (HBM) and of the CPU reference, per GB.

Usage (about 5 minutes on an H200):
    python benchmarks/gpu_copy.py --out gpu_copy.json [--dir /tmp/lazyckpt-bench] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


class Bench:
    """Holds options, the deadline and the results; each section appends rows."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict = {"env": environment(), "sections": {}}
        self.large_bytes = (256 if args.quick else 1024) * MiB

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Callable[[list[dict]], None]) -> None:
        rows: list[dict] = []
        entry = {"rows": rows, "error": None, "seconds": 0.0}
        self.results["sections"][name] = entry
        started = time.monotonic()
        print(f"== {name} ({self.left():.0f}s left)", flush=True)
        try:
            if self.left() < 10:
                raise TimeoutError("skipped: time budget spent")
            fn(rows)
        except BaseException as e:  # noqa: BLE001 - record and go on to the next section
            entry["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
            print(entry["error"], file=sys.stderr, flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        entry["seconds"] = round(time.monotonic() - started, 2)


def environment() -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count, gpu_mem_gib=round(props.total_memory / GiB, 1))
    return env


def timed(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median host seconds from first issue to the end of all GPU work (one warm-up run first)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


# --- workloads ----------------------------------------------------------------------------------------------


def make_sources(sizes: list[int], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Flat uint8 views of CUDA tensors of ``sizes`` bytes each."""
    item = torch.tensor([], dtype=dtype).element_size()
    return [torch.randn(n // item, device="cuda").to(dtype).view(torch.uint8) for n in sizes]


def packed(sources: list[torch.Tensor], align: int) -> tuple[list, int]:
    """Launcher segments (chunked) placing ``sources`` back to back, each start rounded up to ``align``."""
    from lazyckpt.triton_kernels import chunk_segments

    segments, offset = [], 0
    for index, src in enumerate(sources):
        segments += chunk_segments(src.numel(), src=index, dst_offset=offset)
        offset += src.numel() + (-src.numel() % align)
    return segments, offset


def small_sizes(count: int, odd: bool) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(256, 64 * KiB, (count,), generator=gen).tolist()
    # odd: even byte counts packed back to back, so most starts miss 16-byte alignment (the byte path).
    return [s - s % 2 + 2 if odd else s - s % 16 for s in sizes]


def ce_copy(sources: list[torch.Tensor], dst: torch.Tensor, segments: list, stream, per_chunk: bool) -> None:
    with torch.cuda.stream(stream):
        if per_chunk:
            for seg in segments:
                src = sources[seg.src][seg.src_offset : seg.src_offset + seg.nbytes]
                dst[seg.dst_offset : seg.dst_offset + seg.nbytes].copy_(src, non_blocking=True)
            return
        starts = {}
        for seg in segments:
            starts.setdefault(seg.src, seg.dst_offset - seg.src_offset)
        for index, src in enumerate(sources):
            dst[starts[index] : starts[index] + src.numel()].copy_(src, non_blocking=True)


def triton_copy(sources, dst, segments, stream, cache, **options) -> None:
    from lazyckpt.triton_kernels import copy_with_checksums

    with torch.cuda.stream(stream):
        copy_with_checksums(sources, [dst], segments, cache=cache, **options)


# --- sections -----------------------------------------------------------------------------------------------


def correctness(bench: Bench, rows: list[dict]) -> None:
    import lazyckpt
    from lazyckpt.write.staging.triton import AUTO_CE_MIN_BYTES, TritonCopyBackend

    torch.manual_seed(0)
    width = 2048 if bench.args.quick else 4096
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU(),
                                torch.nn.Linear(width, width), torch.nn.Linear(width, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, width, device="cuda")
    for name, options in [("cuda", {"copy_backend": "cuda"}), ("triton", {"copy_backend": "triton"}),
                          ("triton+ce", {"backend": TritonCopyBackend(ce_min_bytes=AUTO_CE_MIN_BYTES)})]:
        root = tempfile.mkdtemp(dir=bench.args.dir)
        mismatches, started = [], time.monotonic()
        with lazyckpt.LazyCheckpointer(root, keep_last_k=1, fsync=False, **options) as ckpt:
            for step in range(1, 4):
                model(x).pow(2).mean().backward()
                ckpt.wait_staged()
                opt.step()
                expected = clone_tree({"model": model.state_dict(), "opt": opt.state_dict()})
                pending = ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step,
                                    optimizers=(opt,))
                ckpt.wait_staged()  # the next update, issued at once with the same gradients
                opt.step()
                opt.zero_grad()
                loaded = lazyckpt.load(pending.wait())
                mismatches += compare_tree(loaded, expected, f"step{step}")
        shutil.rmtree(root, ignore_errors=True)
        rows.append({"backend": name, "checkpoints": 3, "ok": not mismatches, "mismatches": mismatches[:5],
                     "seconds": round(time.monotonic() - started, 2)})


def clone_tree(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone_tree(v) for v in tree)
    return tree


def compare_tree(actual, expected, path: str) -> list[str]:
    if isinstance(expected, torch.Tensor):
        a, e = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
        same = a.dtype == e.dtype and a.shape == e.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                         e.view(-1).view(torch.uint8))
        return [] if same else [path]
    if isinstance(expected, dict):
        return [m for k in expected for m in compare_tree(actual[k], expected[k], f"{path}.{k}")]
    if isinstance(expected, (list, tuple)):
        return [m for i, (a, e) in enumerate(zip(actual, expected)) for m in compare_tree(a, e, f"{path}[{i}]")]
    return [] if actual == expected else [path]


def bandwidth(bench: Bench, rows: list[dict]) -> None:
    from lazyckpt.triton_kernels import TableCache

    stream = torch.cuda.Stream()
    cases = {
        "large": (make_sources([bench.large_bytes // 4] * 4), 16),
        "small<64K aligned": (make_sources(small_sizes(1000, odd=False)), 16),
        "small<64K unaligned": (make_sources(small_sizes(1000, odd=True), torch.bfloat16), 1),
    }
    for case, (sources, align) in cases.items():
        segments, total = packed(sources, align)
        dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        for per_chunk in (False, True):
            seconds = timed(lambda: ce_copy(sources, dst, segments, stream, per_chunk))
            rows.append({"case": case, "path": "copy_ per chunk" if per_chunk else "copy_ per tensor",
                         "K": "-", "block": "-", "warps": "-", "GB/s": gbps(total, seconds)})
        grid = [8, 16, 32, 64] if bench.args.quick else [4, 8, 16, 32, 64, 132]
        configs = [(k, block, warps) for k in grid for block in (4096, 8192, 16384, 32768) for warps in (4, 8)]
        for programs, block, warps in configs:
            if bench.left() < 120:
                rows.append({"case": case, "path": "sweep truncated (time budget)"})
                break
            cache = TableCache()
            options = {"num_programs": programs, "block_bytes": block, "num_warps": warps}
            seconds = timed(lambda: triton_copy(sources, dst, segments, stream, cache, **options))
            rows.append({"case": case, "path": "triton", "K": programs, "block": block, "warps": warps,
                         "GB/s": gbps(total, seconds)})


def crossover(bench: Bench, rows: list[dict]) -> None:
    from lazyckpt.triton_kernels import TableCache

    stream = torch.cuda.Stream()
    total = 64 * MiB
    for size in (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB):
        sources = make_sources([size] * (total // size))
        segments, nbytes = packed(sources, 16)
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        ce = timed(lambda: ce_copy(sources, dst, segments, stream, per_chunk=True))
        row = {"tensor bytes": size, "tensors": len(sources), "copy_ GB/s": gbps(nbytes, ce)}
        for programs in (16, 32):
            cache = TableCache()
            seconds = timed(lambda: triton_copy(sources, dst, segments, stream, cache, num_programs=programs))
            row[f"triton K={programs} GB/s"] = gbps(nbytes, seconds)
        rows.append(row)


def staging(bench: Bench, rows: list[dict]) -> None:
    from lazyckpt.write.plan import PIECE_BYTES, layout, plan_pieces
    from lazyckpt.format.header import TensorEntry
    from lazyckpt.write.staging.cuda import CudaCopyBackend
    from lazyckpt.write.staging.triton import AUTO_CE_MIN_BYTES, TritonCopyBackend

    slots = [t for t in torch.empty(8 * PIECE_BYTES, dtype=torch.uint8, pin_memory=True).split(PIECE_BYTES)]
    workloads = {"large": make_sources([bench.large_bytes // 4] * 4),
                 "1000 small": make_sources(small_sizes(1000, odd=False))}
    backends = {"cuda (device checksum)": lambda: CudaCopyBackend(device_checksum=True),
                "cuda (writer checksums)": lambda: CudaCopyBackend(device_checksum=False),
                "triton K=16": lambda: TritonCopyBackend(num_programs=16),
                "triton K=32": lambda: TritonCopyBackend(num_programs=32),
                "triton+ce (auto)": lambda: TritonCopyBackend(ce_min_bytes=AUTO_CE_MIN_BYTES)}
    for workload, sources in workloads.items():
        entries = [TensorEntry(f"t{i}", "U8", (s.numel(),), s.numel(), lazy=True) for i, s in enumerate(sources)]
        placed, nbytes = layout(entries)
        by_key = {f"t{i}": s for i, s in enumerate(sources)}
        flat = [by_key[e.key] for e in placed]
        pieces = plan_pieces(placed)
        for name, make in backends.items():
            if bench.left() < 60:
                rows.append({"workload": workload, "backend": f"{name}: truncated (time budget)"})
                continue
            backend = make()

            def run() -> None:
                backend.on_request(flat)
                for start in range(0, len(pieces), len(slots)):
                    batch = pieces[start : start + len(slots)]
                    backend.copy_pieces(flat, batch, slots[: len(batch)])

            seconds = timed(run, repeats=2)
            rows.append({"workload": workload, "backend": name, "pieces": len(pieces), "GB/s": gbps(nbytes, seconds)})


def interference(bench: Bench, rows: list[dict]) -> None:
    from lazyckpt.triton_kernels import TableCache

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def matmuls(n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for _ in range(n):
            torch.mm(a, b)
        end.record(main)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    matmuls(3)
    iters = max(10, int(0.4 / max(matmuls(10) / 10, 1e-4)))
    alone = statistics.median(matmuls(iters) for _ in range(3))
    rows.append({"path": "matmul alone", "matmul s": round(alone, 4), "slowdown %": 0.0})
    large = make_sources([bench.large_bytes // 4] * 4)
    small = make_sources(small_sizes(1000, odd=False))
    paths = {"copy_ large": (large, None), "copy_ 1000 small": (small, None)}
    for programs in (8, 16, 32):
        paths[f"triton large K={programs}"] = (large, programs)
    paths["triton 1000 small K=16"] = (small, 16)
    for name, (sources, programs) in paths.items():
        segments, total = packed(sources, 16)
        dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        cache = TableCache()
        if programs is None:
            issue = lambda: ce_copy(sources, dst, segments, side, per_chunk=False)  # noqa: E731
        else:
            issue = lambda: triton_copy(sources, dst, segments, side, cache, num_programs=programs)  # noqa: E731
        one = timed(issue, repeats=1)
        repeats = max(1, int(alone * 1.2 / one))
        for _ in range(repeats):  # enough copy work queued to overlap the whole matmul loop
            issue()
        loaded = matmuls(iters)
        rows.append({"path": name, "matmul s": round(loaded, 4), "slowdown %": round(100 * (loaded / alone - 1), 2),
                     "copy GB/s alone": gbps(total, one)})


def checksum_cost(bench: Bench, rows: list[dict]) -> None:
    from lazyckpt.format.checksum import checksum_bytes
    from lazyckpt.triton_kernels import TableCache, checksum_segments

    sources = make_sources([bench.large_bytes // 4] * 4)
    segments, total = packed(sources, 16)
    for programs in (16, 132, 528):
        cache = TableCache()
        seconds = timed(lambda: checksum_segments(sources, segments, cache=cache, num_programs=programs))
        rows.append({"what": f"checksum kernel K={programs} (HBM read)", "GB/s": gbps(total, seconds),
                     "ms per GB": round(seconds / total * 1e12, 3)})
    host = sources[0][: 256 * MiB].cpu().numpy()
    start = time.perf_counter()
    for i in range(0, host.size, MiB):
        checksum_bytes(host[i : i + MiB])
    seconds = time.perf_counter() - start
    rows.append({"what": "CPU checksum_bytes (1 thread)", "GB/s": gbps(host.size, seconds),
                 "ms per GB": round(seconds / host.size * 1e12, 3)})


# --- output -------------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    env = results["env"]
    lines = [f"# GPU copy benchmark: {env.get('gpu', 'no GPU')}, torch {env['torch']}, triton {env.get('triton')}"]
    for name, entry in results["sections"].items():
        lines += ["", f"## {name} ({entry['seconds']} s)"]
        if entry["error"]:
            lines.append(f"ERROR: {entry['error'].splitlines()[0]}")
        rows = entry["rows"]
        if rows:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--dir", default=None, help="scratch directory for checkpoints (default: system temp)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop starting sweeps after this long")
    parser.add_argument("--quick", action="store_true", help="smaller tensors and grids")
    parser.add_argument("--only", nargs="*", default=None, help="run only these sections")
    args = parser.parse_args(argv)
    bench = Bench(args)
    sections = {"correctness": correctness, "bandwidth": bandwidth, "crossover": crossover, "staging": staging,
                "interference": interference, "checksum": checksum_cost}
    if not torch.cuda.is_available():
        bench.results["error"] = "no CUDA device: nothing to measure"
    else:
        for name, fn in sections.items():
            if args.only is None or name in args.only:
                bench.run(name, lambda rows, fn=fn: fn(bench, rows))
                with open(args.out, "w") as f:  # keep partial results if a later section hangs
                    json.dump(bench.results, f, indent=1, default=str)
    with open(args.out, "w") as f:
        json.dump(bench.results, f, indent=1, default=str)
    print(markdown(bench.results))
    return 0 if "error" not in bench.results else 1


if __name__ == "__main__":
    sys.exit(main())
