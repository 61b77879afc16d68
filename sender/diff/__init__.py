"""What changed since the receivers' version: the snapshot (where it lives, lent whole
copies), the compare behind one interface (``compare.py``) with its host (``compare_host``,
numba's ``fastdiff``) and device (``compare_device``, in ``runs``) implementations, and the
``Changes`` they hand the encoder.

May import the sender's floor (``sender.plan``, ``sender.stats``, ``sender.streams``) and
``protocol``; nothing of the other rooms.
"""
