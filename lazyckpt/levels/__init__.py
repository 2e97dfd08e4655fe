"""The levels a checkpoint lives on, each with its own cadence and retention, built on the write and read paths.

| module | owns |
|---|---|
| ``memory`` | :class:`~lazyckpt.levels.memory.MemoryLevel`: the newest committed snapshot kept in the staging pool, for a rollback without the disk |
| ``host`` | the host level (``keep_in_memory="host"``): steps commit first in shared memory that outlives the process, then in ``dirpath``; restart recovery, folder hygiene |
| ``directory`` | the local level: the directory lock, who leads a directory, crash leftovers, step order, ``keep_last_k`` after each commit |
| ``retention`` | pure keep/purge decisions over committed steps, shared by every level |
| ``aliases`` | names of checkpoints on disk (``last.ckpt -> step-0000040``), links through the storage seam |
| ``peer`` | the peer copy (``memory_peers=1``): host snapshots kept on another node, restored after a lost node (package: ``wire``, ``level``, ``restore``) |
| ``remote`` | the remote level behind the local one (package: ``upload``, ``tickets``, ``meeting``, ``contents``, ``fetch``, ``spool``, ``recovery``) |
"""
