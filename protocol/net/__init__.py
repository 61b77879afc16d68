"""ZeroMQ plumbing both daemons share: the version server (ROUTER, per-peer pumps,
heartbeats), its socket options and sends, the per-receiver bookkeeping, CURVE keys and
the ZAP handler."""
