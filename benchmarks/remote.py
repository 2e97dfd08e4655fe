"""The remote level on the default workload: training stall with and without ``remote=``, and upload throughput
next to a plain s3fs ``put`` of the same bytes, against a real S3 API (moto's server in its own process).

Usage:
    python benchmarks/remote.py                    # default workload (~25M parameters), 4 measured checkpoints
    python benchmarks/remote.py --params-m 5 --checkpoints 2
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import Batches, Workload, build_model, lm_loss, make_optimizer  # noqa: E402

import lazyckpt  # noqa: E402
from lazyckpt.storage.fsspec import FsspecStorage  # noqa: E402


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(600):  # the server needs a moment to import; poll its port
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
            return server, endpoint
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def train(w: Workload, dirpath: str, **options) -> tuple[list[float], list[tuple[int, float]], str]:
    """Median-ready stalls (s) of the measured checkpoints, (bytes, seconds) per upload, one tensor file."""
    model = build_model(w)
    opt = make_optimizer(w, model.parameters())
    batches = Batches(w)
    ckpt = lazyckpt.LazyCheckpointer(dirpath, keep_last_k=2, **options)
    for step in range(1, w.verified_step + 1):
        lm_loss(model, batches[step - 1]).backward()
        ckpt.wait_staged()
        opt.step()
        opt.zero_grad()
        if w.is_checkpoint(step):
            ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step, optimizers=[opt])
    ckpt.close()
    stalls = [s.stall_s for s in ckpt.stats if s.step > w.every]
    uploads = [(u.nbytes, u.seconds) for u in (ckpt.remote.completed if ckpt.remote else []) if u.step > w.every]
    newest = lazyckpt.latest(dirpath)
    return stalls, uploads, os.path.join(newest, "rank-00000-of-00001.safetensors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=Workload.params_m)
    parser.add_argument("--checkpoints", type=int, default=4)
    args = parser.parse_args(argv)
    w = Workload(params_m=args.params_m, checkpoints=args.checkpoints, threads=torch.get_num_threads())
    server, endpoint = start_moto()
    options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench",
               "client_kwargs": {"region_name": "eu-west-1"}}
    try:
        with tempfile.TemporaryDirectory(prefix="lazyckpt-bench-remote-") as root:
            plain, _, _ = train(w, f"{root}/plain", fsync=False)
            remote, uploads, tensor_file = train(w, f"{root}/remote", fsync=False, remote="s3://bench/run",
                                                 remote_keep_last_k=1, storage_options=options)
            put_s, ours_idle_s = put_seconds(tensor_file, options)
            size = os.path.getsize(tensor_file)
    finally:
        server.terminate()
        server.wait()
    ours = statistics.median(n / s for n, s in uploads) / 1e6
    theirs, ours_idle = size / put_s / 1e6, size / ours_idle_s / 1e6
    print(f"workload: {w.params_m:g}M parameters, {w.checkpoints} measured checkpoints every {w.every} steps, "
          f"{torch.get_num_threads()} torch threads")
    print(f"stall per checkpoint, median: without remote {statistics.median(plain) * 1e3:.1f} ms, "
          f"with remote {statistics.median(remote) * 1e3:.1f} ms")
    print("stall of each measured checkpoint (ms): without remote "
          f"{[round(s * 1e3, 1) for s in plain]}, with remote {[round(s * 1e3, 1) for s in remote]}")
    print(f"upload throughput while training, median: lazyckpt {ours:.0f} MB/s")
    print(f"upload of the same tensor file ({size / 1e6:.0f} MB) after training (median of 3): lazyckpt's upload "
          f"{ours_idle:.0f} MB/s, plain s3fs put_file {theirs:.0f} MB/s; ratio {ours_idle / theirs:.2f}x")
    return 0


def put_seconds(local_file: str, options: dict, repeats: int = 3) -> tuple[float, float]:
    """Median seconds of a plain s3fs ``put_file`` and of lazyckpt's multipart upload of ``local_file`` after
    training, alternating the two."""
    storage = FsspecStorage("s3://bench-put/x", options)
    storage.make_dir("s3://bench-put/x")
    plain, ours = [], []
    for _ in range(repeats):
        started = time.monotonic()
        storage.fs.put_file(local_file, "bench-put/x/plain")
        plain.append(time.monotonic() - started)
        started = time.monotonic()
        storage.upload_file(local_file, "s3://bench-put/x/lazyckpt")
        ours.append(time.monotonic() - started)
    return statistics.median(plain), statistics.median(ours)

if __name__ == "__main__":
    sys.exit(main())
