"""The peer copy (``memory_peers=1``): each rank's host snapshot kept in the host memory of a rank on another node.

| module | concern |
|---|---|
| ``wire`` | one step's files sent to and received from ranks of other nodes over a gloo group of its own |
| ``level`` | the transfer thread after each host commit, the copies kept for others, their retention |
| ``restore`` | at construction, a lost node's ranks get their newest step back from their keepers' copies |
"""
