"""``python -m receiver``: the receiver daemon (``receiver/daemon.py``; ``--help``), or
``python -m receiver ctl ...``, the control API's client (``receiver/http_client.py``), which
starts without loading torch."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ctl"]:
        from .http_client import main as ctl_main

        sys.exit(ctl_main(argv[1:]))
    from .daemon import main as daemon_main

    daemon_main(argv)


if __name__ == "__main__":
    main()
