"""What processes on one host share: named shared-memory regions, snapshot files, and
the command-line plumbing of ``python -m sender`` / ``python -m receiver``."""
