"""Backing up a ps task's part (`--ps-replicas 2`): the primary's forwarding and the backup's mirror.

The primary's side: `replicator.py` forwards each mutating call of a served part to its backup, numbered,
holds the replies until the backup has what they show, and seeds the backup anew now and then
(`fresh_seeds.py` says when); `own_connections.py` keeps each thread's own connections to the backup and their unread
acks; `to_backup.py` wires that protocol to this process (remote calls, a same-host link, the store's
marks). The backup's side: `mirror.py` its copy of the part, held in order and applied only when needed
(promoted, it serves a lost primary's part). Both sides: `mirror_link.py` the pushes' gradients through
shared memory on one host, `snapshot.py` a service's whole state (what seeds a mirror and restores a lost
primary). What crosses between them is `ps/replication_messages.py`. Nothing here imports the endpoints:
they call in (`endpoints.py` creates a part's replication, hands a mirror its frames, promotes one).
"""
