"""The write path, in the order a checkpoint takes it: ``save()`` captures on the training thread, the copier
stages the bytes in host memory, the shared writer persists them, and the job ends committed or discarded.

| module | owns |
|---|---|
| ``capture`` | what ``save()`` does on the training thread: flatten, classify lazy/eager, plan, eager copies, free space |
| ``structure`` | what follows from a state's structure alone (ownership, boxes, signature, layouts), planned once per structure |
| ``plan`` | pure layout: tensors -> file offsets -> pieces (<= 8 MiB) made of checksum segments (<= 1 MiB) |
| ``staging`` | the bounded host pool and the copy backends (``cpu``, ``cuda``, ``triton``) behind ``CopyBackend`` |
| ``copier`` | one thread per checkpointer: stages lazy pieces through the pool, hands pieces to the writer |
| ``writer`` | one thread per process: a FIFO of write and call tasks; adjacent pieces gathered into one write |
| ``job`` | one checkpoint in flight and its state machine (``JobState``, one transition function) |
| ``inflight`` | the checkpoints in flight (up to ``max_in_flight``), oldest first: commit order, error hand-off order |
| ``commit`` | how a job ends (:class:`~lazyckpt.write.commit.JobEnds`: barrier, finalize, commit, discard) and the commit protocol |
| ``stats`` | :class:`~lazyckpt.CheckpointStats`, a bounded window of them and running totals |
"""
