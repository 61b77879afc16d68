"""The strategies (``base.py``: ``ReceiverBase``; ``patch.py``, ``bucket.py``, made by
``factory.py``): the handshake, a version's messages collected, checked and staged
(``pending.py``), the hooks a strategy calls around each version (``hooks.py``), the write
side held while a version is written (``write_side.py``).

May import ``receiver.apply``, the receiver's floor and ``protocol``.
"""
