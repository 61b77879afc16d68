"""``python -m receiver``: the receiver daemon (``receiver/control/daemon.py``; ``--help``), or
``python -m receiver ctl ...``, the control API's client (``receiver/control/http_client.py``), which
starts without loading torch, or ``python -m receiver compile``, which compiles the kernels
into numba's cache ahead of the first start."""

from __future__ import annotations

import sys


def compile_main(argv: list[str]) -> int:
    """``python -m receiver compile``: fill numba's cache now (an image build, an install)
    rather than in the first start, which on a fresh install compiles for tens of seconds.
    ``--pairs`` as the sender's: the receiver compiles for their rollout (second) dtypes."""
    import time

    from protocol.codec.aot import compile_args, receiver_dtypes
    from protocol.host.cli import report

    from .apply.warmup import compile_kernels

    pairs, given = compile_args("python -m receiver compile", compile_main.__doc__, argv)
    started = time.perf_counter()
    compile_kernels(receiver_dtypes(pairs))
    report("compiled", side="receiver", pairs=given, seconds=round(time.perf_counter() - started, 2))
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ctl"]:
        from .control.http_client import main as ctl_main

        sys.exit(ctl_main(argv[1:]))
    if argv[:1] == ["compile"]:
        sys.exit(compile_main(argv[1:]))
    from .control.daemon import main as daemon_main

    daemon_main(argv)


if __name__ == "__main__":
    main()
