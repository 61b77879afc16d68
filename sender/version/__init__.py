"""A version built from what changed: the encoder behind one interface (``encode.py``, the
device one in ``encode_device.py``), a part's PATCH message and part cutting, the patch and
bucket builders behind ``builder.VersionBuilder`` (made by ``builders.py`` alone).

May import ``sender.diff``, the sender's floor and ``protocol``.
"""
