"""Coordination between ranks: where this process stands, who writes which bytes, and how ranks agree, through
the process group's key-value store only (never a collective off the training thread, never a shared file).

| module | owns |
|---|---|
| ``group`` | the one look-up of this process's rank, the number of ranks and the group's store |
| ``rendezvous`` | :class:`~lazyckpt.ranks.rendezvous.Rendezvous`: directory leaders, plan agreement, durable marks and failures keyed per attempt; :func:`~lazyckpt.ranks.rendezvous.poll_until` |
| ``liveness`` | each rank's heartbeat through the store; a wait gives up on a peer it still needs once that peer died or closed (``peer_timeout_s``) |
| ``sharding`` | ownership: DTensor shards by their owners, replicated tensors split by bytes, per-rank values; a DTensor's local block |
| ``topology`` | which ranks share a node (host name and ``torchrun``'s node rank), and the ring that pairs each rank with a keeper on the next node |
| ``replicas`` | the immutability window's tensors (:func:`~lazyckpt.ranks.replicas.window_tensors`), and which tensors of a replicated state really agree on every rank |
"""
