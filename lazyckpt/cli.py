"""``lazyckpt`` command line: list, inspect, verify and export checkpoints, through the strict reader only.

Exit codes: 0 everything checked is fine, 1 a problem was found (one line per problem), 2 bad usage.

Example:
    $ lazyckpt ls runs/ckpt
    $ lazyckpt show runs/ckpt/step-0000120
    $ lazyckpt verify runs/ckpt/step-0000120
    $ lazyckpt export runs/ckpt/last.ckpt out/model.safetensors --format safetensors
    $ lazyckpt export hf-run/checkpoint-6 handed-over --format transformers
    $ lazyckpt memory ls                      # the host folders of keep_in_memory="host" (docs/memory.md)
    $ lazyckpt memory clear                   # free those of dead jobs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from rich.console import Console
from rich.filesize import decimal as human_size
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from lazyckpt.errors import CheckpointFormatError, CheckpointNotFoundError
from lazyckpt.format.catalog import committed_steps
from lazyckpt.format.files import MANIFEST
from lazyckpt.interop.export import FORMATS, export
from lazyckpt.interop.lightning_format import monitored_scores
from lazyckpt.levels.aliases import alias_step
from lazyckpt.levels.host import clear_host_folders, host_folders
from lazyckpt.read.reader import CheckpointReader
from lazyckpt.storage import FileKind, LocalStorage, Storage
from lazyckpt.storage.metered import MeteredReads
from lazyckpt.storage.urls import DEFAULT_HOST_ROOT, host_root, is_url, join, reaching

PROGRESS_MIN_BYTES = 256 << 20
"""``verify`` shows a progress bar from this many tensor bytes on (smaller ones finish before it would draw)."""
PROBLEMS = (CheckpointFormatError, CheckpointNotFoundError, OSError)
"""What a checkpoint or a file system can do wrong; anything else is a bug and keeps its traceback."""


class _Cli:
    def __init__(self, storage: Storage, out: Console, err: Console) -> None:
        self.storage, self.out, self.err = storage, out, err

    def problem(self, message: str) -> None:
        self.err.print(Text(f"lazyckpt: {message}", style="red"), soft_wrap=True)

    def _bar(self, description: str, nbytes: int) -> Progress:
        """A bar of bytes for a long read (``verify``, ``export``), from ``PROGRESS_MIN_BYTES`` on: drawn on a
        terminal, one line in a log (where a bar is not drawn)."""
        if nbytes >= PROGRESS_MIN_BYTES and not self.err.is_terminal:
            self.err.print(f"{description}: {human_size(nbytes)} of tensors", style="dim", soft_wrap=True)
        return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), TimeRemainingColumn(), console=self.err, transient=True,
                        disable=nbytes < PROGRESS_MIN_BYTES)

    def _tensor_bytes_of(self, path: str) -> int:
        """The tensor files' bytes of a step directory (0 when they cannot be told: the reader will say why)."""
        try:
            return _file_bytes(self.storage, path, suffix=".safetensors")
        except Exception:  # noqa: BLE001 - only a progress figure: the export itself reports what is wrong
            return 0

    def checkpoint_of(self, path: str) -> str:
        """``path``, or its newest committed checkpoint when ``path`` is a run directory (``show`` and ``verify``
        act on that one and say so; ``ls`` lists them all)."""
        if self.storage.stat(join(path, MANIFEST)) is not None:
            return path
        newest = max(_committed_or_none(path, self.storage).items(), default=None)
        if newest is None:
            return path  # not a run directory either: the reader says what it is
        self.err.print(f"{path} is a run directory: using its newest checkpoint, {newest[1]} (`lazyckpt ls {path}` "
                       "lists them all)", style="dim", soft_wrap=True)
        return newest[1]

    # --- ls -------------------------------------------------------------------------------------------------

    def ls(self, args: argparse.Namespace) -> int:
        info = self.storage.stat(args.dirpath)
        if info is not None and info.kind is FileKind.LINK:
            info = self.storage.stat(self.storage.resolve(args.dirpath))
        if info is None or info.kind is not FileKind.DIR:
            self.problem(f"{args.dirpath} is not a directory")
            return 1
        steps = committed_steps(args.dirpath, self.storage)
        if not steps:
            self.out.print(f"no committed checkpoints in {args.dirpath}")
            return 0
        names = self._names(args.dirpath)
        newest = max(steps)
        rows = []
        for step, path in sorted(steps.items()):
            labels = ", ".join(sorted(names.get(step, []))) + (" (latest)" if step == newest else "")
            rows.append([str(step), Text(os.path.basename(path)), Text(labels.strip()), self._committed_at(path),
                         human_size(_file_bytes(self.storage, path)), Text(self._monitored(path, names.get(step, [])))])
        columns = ["step", "directory", "names", "committed", "size", "monitored"]
        if not any(row[-1].plain for row in rows):  # no ModelCheckpoint scores: no column for them
            columns, rows = columns[:-1], [row[:-1] for row in rows]
        table = Table(*columns, title=Text(args.dirpath), title_justify="left")
        for row in rows:
            table.add_row(*row)
        self.out.print(table)
        return 0

    def _names(self, dirpath: str) -> dict[int, list[str]]:
        """Links in ``dirpath`` that name a step directory (Lightning's ``last.ckpt``, top-k names)."""
        names: dict[int, list[str]] = {}
        for name in self.storage.list_dir(dirpath):
            step = alias_step(self.storage, os.path.join(dirpath, name))
            if step is not None:
                names.setdefault(step, []).append(name)
        return names

    def _monitored(self, path: str, names: list[str]) -> str:
        """``monitor=score`` of this step's top-k names, from the ``ModelCheckpoint`` state a Lightning checkpoint
        holds (the score's bytes alone are read); empty when none is known."""
        if not names:  # only a top-k name can carry a score: do not open the checkpoint
            return ""
        try:
            return ", ".join(f"{monitor}={score:.5g}" for monitor, score in
                             monitored_scores(CheckpointReader(path, self.storage), set(names)))
        except PROBLEMS:
            return "?"

    def _committed_at(self, path: str) -> str:
        info = self.storage.stat(os.path.join(path, MANIFEST))
        return datetime.datetime.fromtimestamp(info.mtime).strftime("%Y-%m-%d %H:%M:%S") if info else "?"

    # --- show -----------------------------------------------------------------------------------------------

    def show(self, args: argparse.Namespace) -> int:
        try:
            reader = CheckpointReader(self.checkpoint_of(args.path), self.storage)
            if not 0 <= args.rank < reader.world_size:
                self.problem(f"--rank {args.rank} is out of range: {reader.path} has {reader.world_size} rank(s)")
                return 2
            state = reader.outline(args.rank)
        except PROBLEMS as e:
            self.problem(str(e))
            return 1
        top = reader.top
        title = Text(f"{reader.path}  step {top['step']}, rank {args.rank} of {top['world_size']}, format "
                     f"{top['format_version']}")
        root = Tree(title)
        total = _add_node(root, "state", state, args.depth, 0)
        root.label = Text.assemble(title, f"  {human_size(total)} of tensors", style="bold")
        self.out.print(root)
        self.out.print("tensor bytes were not read; `lazyckpt verify` checks their checksums", style="dim")
        return 0

    # --- verify ---------------------------------------------------------------------------------------------

    def verify(self, args: argparse.Namespace) -> int:
        failed = 0
        for path in args.paths:
            failed += self._verify_one(path)
        return 1 if failed else 0

    def _verify_one(self, path: str) -> int:
        started = time.monotonic()
        try:
            reader = CheckpointReader(self.checkpoint_of(path), self.storage)
        except PROBLEMS as e:
            self.problem(str(e))
            return 1
        total, problems, checked = _file_bytes(reader.storage, reader.path, suffix=".safetensors"), 0, 0
        with self._bar(f"verifying {os.path.basename(reader.path)}", total) as bar:
            task = bar.add_task(f"verifying {os.path.basename(reader.path)}", total=total)
            for rank in range(reader.world_size):
                try:
                    reader.check_rank(rank, progress=lambda n: bar.advance(task, n))
                    checked += 1
                except PROBLEMS as e:
                    problems += 1
                    self.problem(str(e))
        seconds = time.monotonic() - started
        if problems:
            self.err.print(f"FAILED {reader.path}: {problems} of {reader.world_size} rank(s) have problems",
                           style="bold red", soft_wrap=True)
            return 1
        self.out.print(f"OK {reader.path}: step {reader.top['step']}, {checked} rank(s), {human_size(total)} of "
                       f"tensor files checked in {seconds:.2f} s", style="green", soft_wrap=True)
        return 0

    # --- export ---------------------------------------------------------------------------------------------

    def export(self, args: argparse.Namespace) -> int:
        try:
            nbytes = self._tensor_bytes_of(args.path)
            what = f"exporting {args.path} to {args.out}, reading and checking every checksum"
            with self._bar(what, nbytes) as bar:
                task = bar.add_task(what, total=nbytes)
                out = export(args.path, args.out, format=args.format, key=args.key, strip_prefix=args.strip_prefix,
                             dedupe=not args.keep_duplicates,
                             storage=MeteredReads(self.storage, on_bytes=lambda n: bar.advance(task, n)))
        except PROBLEMS as e:
            self.problem(str(e))
            return 1
        except ValueError as e:  # the arguments (an out file that is a URL): bad usage
            self.problem(str(e))
            return 2
        local = LocalStorage()  # written locally, wherever the checkpoint was read from
        info = local.stat(out)
        if info is not None and info.kind is FileKind.DIR:  # the Trainer's checkpoint folder
            names = ", ".join(sorted(local.list_dir(out)))
            self.out.print(f"wrote {out} ({human_size(_file_bytes(local, out))}, {args.format}: {names})",
                           soft_wrap=True)
            return 0
        self.out.print(f"wrote {out} ({human_size(info.size if info else 0)}, {args.format})", soft_wrap=True)
        return 0

    # --- memory ls, memory clear ----------------------------------------------------------------------------

    def memory_ls(self, args: argparse.Namespace) -> int:
        folders = host_folders(args.root, self.storage)
        if not folders:
            self.out.print(f"no host folders under {host_root(args.root)}", soft_wrap=True)
            return 0
        table = Table("dirpath", "job", "size", "steps", "unsaved", title=Text(host_root(args.root)),
                      title_justify="left")
        job = {True: Text("live", "green"), False: Text("dead"), None: Text("? (not this user's)", "dim")}
        for f in folders:
            table.add_row(Text(f.dirpath or f"? ({f.path})"), job[f.live], human_size(f.nbytes), _steps(f.steps),
                          Text(_steps(f.unsaved), "bold red"))
        self.out.print(table)
        return 0

    def memory_clear(self, args: argparse.Namespace) -> int:
        freed, kept = clear_host_folders(args.root, discard=args.discard, storage=self.storage)
        for f in freed:
            lost = f", discarded steps {f.unsaved}" if f.unsaved else ""
            self.out.print(f"freed {f.path} ({f.dirpath or '?'}, {human_size(f.nbytes)}{lost})", soft_wrap=True)
        for f in kept:
            self.out.print(f"kept {f.path} ({f.dirpath or '?'}): {f.why_kept(discard=args.discard)}", soft_wrap=True)
        if not freed and not kept:
            self.out.print(f"no host folders under {host_root(args.root)}", soft_wrap=True)
        return 0


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


def _committed_or_none(path: str, storage: Storage) -> dict[int, str]:
    try:
        return committed_steps(path, storage)
    except PROBLEMS:
        return {}


def _file_bytes(storage: Storage, path: str, *, suffix: str = "") -> int:
    """Total size of the plain files directly in ``path`` whose names end with ``suffix``."""
    infos = (storage.stat(os.path.join(path, n)) for n in storage.list_dir(path) if n.endswith(suffix))
    return sum(i.size for i in infos if i is not None and i.kind is FileKind.FILE)


def _children(value: Any) -> Iterator[tuple[str, Any]] | None:
    if isinstance(value, dict):
        return ((str(k), v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ((f"[{i}]", v) for i, v in enumerate(value))
    return None


def _add_node(parent: Tree, name: str, value: Any, depth: int | None, level: int,
              seen: dict[int, str] | None = None, path: str = "") -> int:
    """Add ``value`` under ``parent`` (children down to ``depth``); returns its tensor bytes. A tensor met before
    (a tied weight, stored once: docs/FORMAT.md rule 22) is marked tied to its first key path and counted once."""
    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        described = f"  {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
        if id(value) in seen:
            parent.add(Text.assemble((name, "bold"), described, (f"  tied to {seen[id(value)]}", "dim")))
            return 0
        seen[id(value)] = path
        nbytes = value.numel() * value.element_size()
        parent.add(Text.assemble((name, "bold"), f"{described}  {human_size(nbytes)}"))
        return nbytes
    children = _children(value)
    if children is None:
        text = repr(value)
        parent.add(Text.assemble((name, "bold"), f"  {text if len(text) <= 60 else text[:57] + '...'}",
                                 style="dim" if value is None else ""))
        return 0
    node = parent.add(Text(name))
    collapsed = depth is not None and level >= depth
    total, count = 0, 0
    for key, child in children:
        total += _add_node(Tree("") if collapsed else node, key, child, depth, level + 1, seen,
                           f"{path}/{key}" if path else str(key))
        count += 1
    kind = type(value).__name__
    node.label = Text.assemble((name, "bold"), f"  {kind} of {count}", f"  {human_size(total)}" if total else "")
    return total


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazyckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list the committed checkpoints of a directory")
    p.add_argument("dirpath", help="a directory or an fsspec URL (s3://bucket/run)")
    p.set_defaults(fn=_Cli.ls)
    p = sub.add_parser("show", help="print a checkpoint's state as a tree (dtype, shape, bytes per subtree)")
    p.add_argument("path")
    p.add_argument("--rank", type=int, default=0, help="whose state to show (default 0)")
    p.add_argument("--depth", type=int, default=None, help="show children down to this depth (default: all)")
    p.set_defaults(fn=_Cli.show)
    p = sub.add_parser("verify", help="check every rule and checksum of one or more checkpoints")
    p.add_argument("paths", nargs="+", metavar="path")
    p.set_defaults(fn=_Cli.verify)
    p = sub.add_parser("export", help="write a checkpoint as a Lightning .ckpt, a model.safetensors or a Hugging "
                                      "Face Trainer checkpoint folder")
    p.add_argument("path", help="a checkpoint directory or its URL (s3://bucket/run/step-0000040)")
    p.add_argument("out", help="the local file to write (transformers: a directory that does not exist yet)")
    p.add_argument("--format", choices=FORMATS, default="lightning",
                   help="lightning: a .ckpt that torch.load(weights_only=True) accepts; safetensors: the model's "
                        "weights under their plain names; transformers: the Trainer's own checkpoint folder "
                        "(model.safetensors, config.json, trainer_state.json, optimizer.pt, scheduler.pt, "
                        "rng_state.pth) of a LazyCheckpointCallback checkpoint, which a plain Trainer resumes from "
                        "and from_pretrained loads (default lightning)")
    p.add_argument("--key", default=None, help="safetensors: the top-level key holding the weights (default: "
                                               "state_dict, else model)")
    p.add_argument("--strip-prefix", default=None,
                   help="safetensors: remove this prefix from every name (default: the prefix all names of a "
                        "Lightning state_dict share, e.g. 'model.')")
    p.add_argument("--keep-duplicates", action="store_true",
                   help="safetensors, transformers: store bit-identical tensors (tied weights) under every name")
    p.set_defaults(fn=_Cli.export)
    for p in sub.choices.values():
        p.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                       help='fsspec options for a URL, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'')
    memory = sub.add_parser("memory", help="the host folders of keep_in_memory='host' (shared memory)")
    memory_commands = memory.add_subparsers(dest="memory_command", required=True)
    for name, fn, what in (("ls", _Cli.memory_ls, "list them: dirpath, live or dead job, size, steps not on disk"),
                           ("clear", _Cli.memory_clear, "free those of dead jobs whose steps are all in dirpath")):
        q = memory_commands.add_parser(name, help=what)
        q.add_argument("--root", default=None, help=f"where the host folders are (default {DEFAULT_HOST_ROOT}; "
                                                    "a checkpointer's host_memory_dir)")
        q.set_defaults(fn=fn, storage_options=None)
    q.add_argument("--discard", action="store_true", help="free also the folders of dead jobs holding steps "
                                                          "dirpath lacks (those steps are lost)")
    return parser


def main(argv: list[str] | None = None, *, storage: Storage | None = None) -> int:
    args = build_parser().parse_args(argv)
    out, err = Console(), Console(stderr=True)
    name, first_url = _first_url(args)
    try:
        with reaching(name, first_url or "", args.storage_options):  # botocore's errors: one line naming the URL
            cli = _Cli(storage if storage is not None else _storage_for(args), out, err)
            return args.fn(cli, args)
    except PROBLEMS as e:  # RemoteUnreachableError, and what a command leaves to main (``memory``)
        _Cli(LocalStorage(), out, err).problem(str(e))
        return 1


def _first_url(args: argparse.Namespace) -> tuple[str, str | None]:
    """The first checkpoint argument that is a URL, and its name (for the message when it cannot be reached)."""
    named = [(name, getattr(args, name)) for name in ("dirpath", "path") if hasattr(args, name)]
    named += [("path", path) for path in getattr(args, "paths", [])]
    return next(((name, path) for name, path in named if is_url(path)), ("path", None))


def _storage_for(args: argparse.Namespace) -> Storage:
    """Local files, or an fsspec storage when the checkpoint arguments are URLs (all of one file system)."""
    paths = [getattr(args, name) for name in ("dirpath", "path") if hasattr(args, name)] + getattr(args, "paths", [])
    urls = [p for p in paths if is_url(p)]
    if not urls:
        return LocalStorage()
    if len(urls) != len(paths) or len({u.split("://", 1)[0] for u in urls}) > 1:
        raise SystemExit(f"lazyckpt: {paths} mix local paths and URLs of different kinds; give one kind per call")
    from lazyckpt.storage.fsspec import FsspecStorage

    return FsspecStorage(urls[0], args.storage_options)


if __name__ == "__main__":
    sys.exit(main())
