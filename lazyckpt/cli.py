"""``lazyckpt`` command line: list, verify and inspect checkpoints.

Example:
    $ lazyckpt ls runs/ckpt
    $ lazyckpt verify runs/ckpt/step-0000120
    $ lazyckpt show runs/ckpt/step-0000120
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lazyckpt.errors import CheckpointFormatError, CheckpointNotFoundError
from lazyckpt.format import MANIFEST
from lazyckpt.loading import latest, verify
from lazyckpt.retention import committed_steps


def _ls(args: argparse.Namespace) -> int:
    steps = committed_steps(args.dirpath)
    newest = latest(args.dirpath)
    for step, path in sorted(steps.items()):
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        print(f"{step:>10}  {size / 1e6:10.1f} MB  {path}{'  (latest)' if path == newest else ''}")
    if not steps:
        print(f"no committed checkpoints in {args.dirpath}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    try:
        verify(args.path)
    except (CheckpointFormatError, CheckpointNotFoundError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(f"OK: {args.path}")
    return 0


def _show(args: argparse.Namespace) -> int:
    with open(os.path.join(args.path, MANIFEST)) as f:
        top = json.load(f)
    print(json.dumps(top, indent=2))
    with open(os.path.join(args.path, top["ranks"][0])) as f:
        rank0 = json.load(f)
    for key, info in rank0["tensors"].items():
        print(f"  {key:60s} {info['dtype']:5s} {str(info['shape']):20s} {info['capture']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list committed checkpoints")
    p.add_argument("dirpath")
    p.set_defaults(fn=_ls)
    p = sub.add_parser("verify", help="check every rule and checksum of a checkpoint")
    p.add_argument("path")
    p.set_defaults(fn=_verify)
    p = sub.add_parser("show", help="print a checkpoint's manifest and tensor index")
    p.add_argument("path")
    p.set_defaults(fn=_show)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
