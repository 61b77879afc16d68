"""A version's bytes into the model: a message's checks against the model, its entries
decoded (``decode.py``; device-coded ones a batch at once, ``stage_device.py``; a part's one
copy to a GPU, ``transfer.py``), the only writes into a model (``commit.py``, with the fused
kernels of ``fused.py`` and numba's of ``kernels.py``), the writes read back
(``readback.py``), the digest of what is held, numba's compile step.

May import the receiver's floor and ``protocol``; nothing of the other rooms.
"""
