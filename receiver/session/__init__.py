"""A receiver's connection to its upstream: the session loop (``follower.py``: the handshake
and the versions, one connection at a time), each connection (``session.py``: socket, inbox,
heartbeats, queries), the upstreams tried in turn (``upstreams.py``), a whole model's arrival
as progress (``incoming.py``), and the relay (``relay.py``: a receiver that serves its own).

May import ``receiver.strategy``, ``receiver.apply``, the receiver's floor and ``protocol``.
"""
