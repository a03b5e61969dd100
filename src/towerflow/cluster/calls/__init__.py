"""Calls between tasks on ZeroMQ: this process's endpoint, its sockets, what crosses the wire, who may connect.

`endpoint.py` this process's endpoint (start, call, stop, the state its calls share); `messaging.py` the sockets and their thread;
`direct.py` a connection one thread owns; `connection_events.py` what a connection's monitor reports;
`wire.py` and `wire_flat.py` a message's frames; `wire_security.py` CURVE keys or a password.
"""
