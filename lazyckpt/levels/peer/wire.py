"""How one rank's files of a step travel to a rank of another node: over ``torch.distributed``, file by file.

A transfer runs on a process group of its own (gloo, CPU tensors), made for the peer level at construction: its
point-to-point operations never interleave with the training's collectives on the default group, so a background
thread may issue them (a collective from a second thread on the training's group could pair with the wrong
operation of another rank). Every rank of a transfer runs the same three phases, posting all its sends and
receives of a phase before waiting on any, so a ring of ranks that each send and receive never deadlocks:

1. the length of each sender's header (one ``int64``);
2. the header: JSON ``{"step": N, "files": [[name, size], ...]}`` (no files: the sender no longer had the step);
3. the files' bytes in pieces of :data:`PIECE_BYTES`, in the header's order: one piece per peer and round;
4. each sender's word that every piece it sent was read whole (one ``int64``, 1 or 0).

A side that fails midway (a file that cannot be read or written) goes on sending or receiving every piece and
reports its failure only after phase 4, so the other side is never left blocked and the next transfer pairs up.

The sender reads from files it opened when the step was committed (an open file on a tmpfs outlives its removal
by retention); the receiver writes each file where ``landing`` says, and checks nothing: every chunk is checked
against its checksum when the copy is restored, as for any load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lazyckpt.storage import ReadHandle, Storage

PIECE_BYTES = 16 << 20
"""Bytes per message: a 289 MiB snapshot is 19 pieces; each side holds one piece buffer per peer."""


@dataclass
class Outgoing:
    """One rank's files of one step, opened for sending (their removal meanwhile does not matter)."""

    step: int
    files: list[tuple[str, int]]
    handles: list[ReadHandle] = field(default_factory=list)

    def header(self) -> bytes:
        return json.dumps({"step": self.step, "files": self.files}).encode()

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
        self.handles = []


def open_outgoing(storage: Storage, step_dir: str, names: list[str], step: int) -> Outgoing:
    """``names`` of ``step_dir``, opened; an Outgoing without files when the step is gone already (the receiver
    keeps the copy it has)."""
    out = Outgoing(step, [])
    try:
        for name in names:
            handle = storage.open_read(os.path.join(step_dir, name))
            out.handles.append(handle)
            out.files.append((name, handle.size))
    except OSError:  # FileNotFoundError above all
        out.close()
        return Outgoing(step, [])
    return out


PathOf = Callable[[str], str]
Landing = Callable[[int, dict[str, Any]], PathOf | None]
"""``landing(source rank, its header)``: where each received file goes (``path_of(name)``, its directory made), or
None to drop them."""


def transfer(group: Any, storage: Storage, sends: dict[int, Outgoing], receives: list[int],
             landing: Landing) -> dict[int, dict[str, Any]]:
    """Send each of ``sends`` to its rank and receive from each rank of ``receives`` (see the module docstring);
    returns each source's header once its files are written (not synced: the copy lives on a tmpfs)."""
    lengths = _swap({dst: _int64(len(out.header())) for dst, out in sends.items()},
                    {src: _int64(0) for src in receives}, group)
    headers = _swap({dst: _bytes(out.header()) for dst, out in sends.items()},
                    {src: torch.empty(int(lengths[src].item()), dtype=torch.uint8) for src in receives}, group)
    got = {src: json.loads(bytes(headers[src].numpy())) for src in receives}
    writers = {src: _Writer(storage, landing, src, got[src]) for src in receives}
    try:
        unread = _stream(group, sends, got, writers)
        words = _swap({dst: _int64(dst not in unread) for dst in sends}, {src: _int64(0) for src in receives}, group)
    finally:
        for writer in writers.values():
            writer.close()
    for src, word in words.items():
        if not word.item() and writers[src].error is None:  # what came is not the sender's file: dropped
            writers[src].error = OSError(f"lazyckpt: rank {src} could not read its files of step {got[src]['step']}")
    failed = [unread[dst] for dst in unread] + [w.error for w in writers.values() if w.error is not None]
    if failed:  # raised only now: every piece was still received, so the senders' transfers ended too
        raise failed[0]
    return {src: got[src] for src, writer in writers.items() if writer.handles is not None}


def _fill(handle: Any, offset: int, piece: torch.Tensor) -> BaseException | None:
    """Read a piece to send; on a failure, zeros go instead (phase 4 then tells the receiver to drop them)."""
    try:
        _read_fully(handle, offset, piece)
        return None
    except Exception as e:  # noqa: BLE001 - reported after the transfer, see the module docstring
        piece.zero_()
        return e


def _stream(group: Any, sends: dict[int, Outgoing], got: dict[int, dict[str, Any]],
            writers: dict[int, _Writer]) -> dict[int, BaseException]:
    """Phase 3: piece ``i`` of every file list, to and from every peer, round after round; returns the first read
    failure for each peer whose files could not all be read."""
    unread: dict[int, BaseException] = {}
    out_pieces = {dst: _pieces(out.files) for dst, out in sends.items()}
    in_pieces = {src: _pieces([tuple(f) for f in header["files"]]) for src, header in got.items()}
    out_buffers = {dst: torch.empty(PIECE_BYTES, dtype=torch.uint8) for dst in sends}
    in_buffers = {src: torch.empty(PIECE_BYTES, dtype=torch.uint8) for src in got}
    rounds = max([len(p) for p in (*out_pieces.values(), *in_pieces.values())], default=0)
    for i in range(rounds):
        outgoing = {}
        for dst, pieces in out_pieces.items():
            if i < len(pieces):
                index, offset, length = pieces[i]
                piece = out_buffers[dst][:length]
                error = _fill(sends[dst].handles[index], offset, piece)
                if error is not None:
                    unread.setdefault(dst, error)
                outgoing[dst] = piece
        incoming = {src: in_buffers[src][:pieces[i][2]] for src, pieces in in_pieces.items() if i < len(pieces)}
        _swap(outgoing, incoming, group)
        for src, piece in incoming.items():
            index, offset, _ = in_pieces[src][i]
            writers[src].write(index, offset, piece)
    return unread


def _pieces(files: list[tuple[str, int]]) -> list[tuple[int, int, int]]:
    """``(file index, offset, length)`` of every piece, in order (an empty file has none)."""
    return [(index, offset, min(PIECE_BYTES, size - offset))
            for index, (_, size) in enumerate(files) for offset in range(0, size, PIECE_BYTES)]


def _swap(outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor], group: Any) -> dict[int, torch.Tensor]:
    """Post every send and receive, then wait for all of them; returns ``incoming``, filled."""
    works = [dist.isend(tensor, dst, group=group) for dst, tensor in outgoing.items()]
    works += [dist.irecv(tensor, src, group=group) for src, tensor in incoming.items()]
    for work in works:
        work.wait()
    return incoming


def _int64(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _read_fully(handle: ReadHandle, offset: int, piece: torch.Tensor) -> None:
    view = memoryview(piece.numpy())
    if handle.read_into(offset, view) != len(view):
        raise EOFError(f"lazyckpt: a file of the peer copy ended before {offset + len(view)} bytes")


class _Writer:
    """The received files of one source, created empty where ``landing`` says and written piece by piece. A failure
    (no landing, a full tmpfs) drops the rest of its pieces instead of raising mid-transfer: a receiver that
    stopped receiving would leave its sender blocked until the group's timeout."""

    def __init__(self, storage: Storage, landing: Landing, source: int, header: dict[str, Any]) -> None:
        self.storage, self.error = storage, None
        self.handles: list[Any] | None = []
        try:
            path_of = landing(source, header)
            if path_of is None:
                self.handles = None
                return
            for name, _ in header["files"]:
                self.handles.append(storage.open_write(path_of(name)))
        except Exception as e:  # noqa: BLE001 - raised by transfer() once every piece is received
            self._fail(e)

    def write(self, index: int, offset: int, piece: torch.Tensor) -> None:
        if self.handles is None:
            return
        try:
            self.storage.write(self.handles[index], offset, [memoryview(piece.numpy())])
        except Exception as e:  # noqa: BLE001 - as above
            self._fail(e)

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.close()
        self.handles = None

    def close(self) -> None:
        for handle in self.handles or []:
            self.storage.close(handle, sync=False)
        if self.handles is not None:
            self.handles = []
