"""Same-host shared memory between two tasks: a request/reply link (`shm_link.py`) and a ring of records
one process writes and another takes when it wants them (`shm_ring.py`).
"""
