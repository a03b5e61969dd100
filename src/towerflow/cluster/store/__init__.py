"""The rendezvous store: where it lives and whose cluster it holds (`stores.py`), the c10d stores
(`c10d.py`), and a store in etcd that no task hosts (`etcd.py` the client, `etcd_store.py` the store).
"""
