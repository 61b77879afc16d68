"""The sender as a service: ``Sender`` (``service.py``), the feed of a version's parts to its
server, the version sources (the trainer's model, the sharded leader's), metrics and status,
the sidecar and its client.

May import ``sender.version``, ``sender.diff``, the sender's floor and ``protocol``.
"""
