"""The checkpointing methods of the distributed mode (``compare.py --world-size N``), on gloo ranks (CPU).

Each rank trains the same workload, wrapped by its driver: ``fsdp2`` (``fully_shard`` on every block and on the
root) or ``ddp`` (``DistributedDataParallel``). The state every method saves is what users pass:
``get_state_dict(model, [opt])``. Every method reads its checkpoint back into this rank's live state and
``normalize`` turns it into this rank's local tensors (``model/<fqn>``, ``opt/<fqn>/<key>``), compared with the
reference run's state of the same rank, bit for bit.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from methods import DcpStager, LazyEngine, Method, NoCheckpoint, Run
from peer_torch_checkpointing import TorchCheckpointing, manager_config


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds of ``tensor`` (a DTensor's local shard, a plain tensor itself)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def normalize_local(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{"model": msd, "optim": osd}`` as ``get_state_dict`` keys it -> this rank's local tensors by name."""
    out = {f"model/{k}": local(v) for k, v in state["model"].items()}
    for fqn, per_param in state["optim"]["state"].items():
        out.update({f"opt/{fqn}/{k}": local(v) for k, v in per_param.items() if isinstance(v, torch.Tensor)})
    return out


class Parallel(Method):
    """What every distributed method shares: the driver's wrapping and the state as ``get_state_dict`` gives it."""

    driver = "fsdp2"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.driver == "ddp":
            return torch.nn.parallel.DistributedDataParallel(model)
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.run.model, [self.run.optimizer])
        return {"model": msd, "optim": osd}

    def live_state(self) -> dict[str, torch.Tensor]:
        return normalize_local(self.state())

    def normalize(self, loaded: Any) -> dict[str, torch.Tensor]:
        return normalize_local(loaded)


class NoCheckpointFsdp(Parallel, NoCheckpoint):
    key, label = "none_fsdp2", "no checkpoint (FSDP2)"


class NoCheckpointDdp(Parallel, NoCheckpoint):
    key, label, driver = "none_ddp", "no checkpoint (DDP)", "ddp"


def dcp_upload_group() -> Any:
    """A gloo group for DCP's upload thread, as TorchTitan does: on the training group its collectives would
    interleave with FSDP's and hang both."""
    return dist.new_group(backend="gloo")


class DcpStagerFsdp(Parallel, DcpStager):
    """``dcp.async_save`` + ``DefaultStager`` on every rank, staging awaited before the next optimizer step."""

    key, label = "dcp_stager_fsdp2", "DCP async_save + DefaultStager (FSDP2)"

    def setup(self, run: Run) -> None:
        super().setup(run)
        self.group = dcp_upload_group()

    def _save(self, step: int, **kwargs: Any) -> Any:
        return super()._save(step, process_group=self.group, **kwargs)

    def load(self, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        state = self.state()  # the live DTensors: filled in place, this rank's shards only
        dcp.load(state, checkpoint_id=path)
        return state


class TorchCheckpointingFsdp(Parallel, TorchCheckpointing):
    """``manager.save(path, get_state_dict(...))`` on every rank, each rank's DTensor shards in files of its own;
    the writer processes meet at the store barrier, then rank 0 renames the directory. Read back into the same
    layout. No ``DefaultResharder`` is declared: with one, the first save gathers the sharding metadata across ranks
    in tensors it allocates on ``"cuda"`` (torch-checkpointing 0.1.1), which fails on a CPU machine."""

    key, label = "torch_checkpointing_fsdp2", "torch-checkpointing CheckpointManager (FSDP2)"

    def rank(self) -> int:
        return dist.get_rank()

    def finish(self) -> None:
        super().finish()
        dist.barrier()  # rank 0's rename is done before any rank reads the checkpoint back

    def load(self, path: str) -> Any:
        from torch_checkpointing import CheckpointManager

        reader = CheckpointManager(manager_config(rank=self.rank(), saving=False))
        try:
            return reader.load(path, into=self.state())  # the live DTensors, filled in place
        finally:
            reader.close()


class LazyParallel(Parallel, LazyEngine):
    """``ckpt.save(get_state_dict(...), optimizers=[opt])`` on every rank, the ranks meeting through the store."""

    key, label = "lazyckpt_fsdp2", "lazyckpt (FSDP2)"
    alone = False
    """Rank 0 writes everything as a one-rank checkpointer; the other ranks save nothing."""

    def setup(self, run: Run) -> None:
        Method.setup(self, run)
        import lazyckpt
        from methods import _timed_storage

        self.storage = _timed_storage(**self.storage_options)
        self.saving = not self.alone or dist.get_rank() == 0
        scope = {"rank": 0, "world_size": 1, "store": None} if self.alone else {}
        self.ckpt = lazyckpt.LazyCheckpointer(run.dirpath, fsync=True, storage=self.storage, commit_timeout_s=600,
                                              **scope) if self.saving else None
        self.pending, self.called_at = None, {}

    def request(self, step: int) -> None:
        if self.saving:
            state = self.state()
            self.called_at[step] = time.monotonic()
            self.pending = self.ckpt.save(state, step=step, optimizers=[self.run.optimizer])

    def before_step(self) -> None:
        if self.saving:
            self.ckpt.wait_staged()

    def drain(self) -> None:
        if self.saving:
            super().drain()

    def finish(self) -> None:
        if self.saving:
            self.ckpt.close()
        dist.barrier()  # the last commit is visible to every rank before any of them reads it back

    def durable_seconds(self) -> None:
        return None  # measured from the request, get_state_dict included, as for DCP

    def durable_timestamps(self) -> dict[int, float]:
        """Commit time of each checkpoint: the job is created inside ``save()`` and ``flush_s`` runs from there to
        the commit, so ``save()``'s start + its duration + ``flush_s`` is the commit, or a little after it."""
        stats = self.ckpt.stats if self.saving else []
        return {s.step: self.called_at[s.step] + s.save_s + s.flush_s for s in stats if s.step in self.called_at}

    def written_bytes(self) -> int:
        stats = self.ckpt.stats if self.saving else []
        return stats[-1].nbytes if stats else 0

    def load(self, path: str) -> Any:
        import lazyckpt

        if self.driver == "ddp":
            return lazyckpt.load(path)  # the consolidated full state: every rank holds all of it
        return lazyckpt.load_into(path, self.state())  # the live DTensors, filled in place


class LazyDdpSplit(LazyParallel):
    key, label, driver = "lazyckpt_ddp_split", "lazyckpt (DDP, writes split across ranks)", "ddp"


class LazyDdpRank0(LazyParallel):
    key, label, driver = "lazyckpt_ddp_rank0", "lazyckpt (DDP, rank 0 writes all)", "ddp"
    alone = True


class Reference(Parallel, NoCheckpoint):
    """A driver's reference run: no checkpoint; keeps this rank's state at the verified step and at the end."""

    kind = "reference"

    def __init__(self, driver: str) -> None:
        super().__init__()
        self.driver, self.key, self.at_step = driver, f"reference_{driver}", None

    def request(self, step: int) -> None:
        if step == self.run.workload.verified_step:
            self.at_step = {k: v.clone() for k, v in self.live_state().items()}


DIST_METHODS: dict[str, type[Parallel]] = {cls.key: cls for cls in (
    NoCheckpointFsdp, LazyParallel, DcpStagerFsdp, TorchCheckpointingFsdp, NoCheckpointDdp, LazyDdpSplit, LazyDdpRank0)}
"""Every distributed method, in table order."""

DIST_BASELINE_FOR = {"fsdp2": "none_fsdp2", "ddp": "none_ddp"}
