"""The wire: how a message is laid out in frames, the bounds checked on every inbound
message, the dtype allowlist, receiver metadata and checksums. Bytes and tensors only:
no sockets, no event loop, no threads (tests/test_layering.py keeps it so)."""
