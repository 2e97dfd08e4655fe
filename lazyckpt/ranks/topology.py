"""Which ranks share a node, and which rank of another node keeps each rank's peer copy.

A node is a distinct ``(host name, GROUP_RANK)`` pair: the machine's name, and the node rank that ``torchrun``
gives every process it starts (``--node-rank``; several "nodes" on one machine, as the tests simulate, differ
there). Ranks exchange theirs through the process group's store at construction.

Pairing is a ring over the nodes, ordered by their lowest rank: each rank's copy goes to the rank at the same
local position on the next node (modulo that node's size), and it keeps the copies of the ranks that send to it.
Any number of nodes works, odd ones too: with three, A keeps C's copies, B keeps A's, C keeps B's. A node and
the node keeping its copies are never the same unless there is one node (then there is no peer copy).

Example:
    >>> pair_ranks([[0, 1], [2, 3]])
    ({0: 2, 1: 3, 2: 0, 3: 1}, {2: [0], 3: [1], 0: [2], 1: [3]})
"""

from __future__ import annotations

import os
import socket


def node_name() -> str:
    """This process's node: its host name and ``torchrun``'s node rank (``GROUP_RANK``), when set."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


def nodes_of(names: list[str]) -> list[list[int]]:
    """The ranks of each node, from every rank's :func:`node_name` (by rank); nodes ordered by their lowest rank."""
    nodes: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        nodes.setdefault(name, []).append(rank)
    return sorted(nodes.values(), key=lambda ranks: ranks[0])


def pair_ranks(nodes: list[list[int]]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """``(keeper, kept)``: the rank that keeps each rank's copy (on the next node of the ring), and the ranks whose
    copies each rank keeps. Empty with a single node."""
    if len(nodes) < 2:
        return {}, {}
    keeper: dict[int, int] = {}
    for index, ranks in enumerate(nodes):
        following = nodes[(index + 1) % len(nodes)]
        for position, rank in enumerate(ranks):
            keeper[rank] = following[position % len(following)]
    kept: dict[int, list[int]] = {}
    for rank, holder in keeper.items():
        kept.setdefault(holder, []).append(rank)
    return keeper, kept
