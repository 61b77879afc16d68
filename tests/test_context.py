"""The ZeroMQ context a Sender and Receiver use when given none (protocol/net/context.py):
the process's instance, created with two I/O threads when weightsync creates it, and an
application's own instance used as it is. Each case runs in a fresh interpreter, where no
instance exists yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from protocol.errors import ConfigError
from protocol.net.context import shared_context

SYNC = """
import asyncio, torch, zmq, zmq.asyncio
from receiver import Receiver
from sender import Sender

async def main(first):
    if first is not None:
        zmq.asyncio.Context.instance(io_threads=first)  # the application's, made first
    model = torch.nn.Linear(64, 64)
    rollout = torch.nn.Linear(64, 64)
    async with Sender("tcp://127.0.0.1:0") as sender:
        await sender.start(model, version=0)
        async with Receiver(rollout, sender.endpoint) as receiver:
            await receiver.start()
            with torch.no_grad():
                model.weight[3, :7] += 1.0
            await sender.sync(model, version=1)
            await receiver.wait_for_version(1, timeout=30)
            assert torch.equal(rollout.weight, model.weight)
    print(zmq.asyncio.Context.instance().get(zmq.IO_THREADS))

asyncio.run(main(FIRST))
"""


def io_threads_after_a_sync(first: int | None) -> int:
    script = textwrap.dedent(SYNC).replace("FIRST", repr(first))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.timeout(150)
def test_by_default_the_instance_is_created_with_two_io_threads() -> None:
    assert io_threads_after_a_sync(None) == 2


@pytest.mark.timeout(150)
def test_an_instance_the_application_made_first_is_used_as_it_is() -> None:
    assert io_threads_after_a_sync(1) == 1


@pytest.mark.parametrize("io_threads", [0, -1, 1.5, "2"])
def test_a_bad_io_thread_count_is_a_config_error(io_threads: object) -> None:
    with pytest.raises(ConfigError, match="io_threads"):
        shared_context(io_threads)  # type: ignore[arg-type]


def test_the_sender_daemon_refuses_a_bad_io_thread_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sender.__main__ as smain

    assert smain.parse_args(["--watch", str(tmp_path), "--io-threads", "3"]).io_threads == 3
    with pytest.raises(SystemExit):
        smain.parse_args(["--watch", str(tmp_path), "--io-threads", "0"])
    assert "--io-threads must be at least 1" in capsys.readouterr().err
