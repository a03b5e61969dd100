"""Who is in the cluster: where tasks meet (`rendezvous.py`, `replica_rendezvous.py`, `gather.py`), which
are alive and which incarnation of each (`membership.py`), what a failed task leaves behind (`failures.py`),
and the end of the cluster's work (`ending.py`).
"""
