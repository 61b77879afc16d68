"""weightsync as a vLLM weight-transfer backend, named ``weightsync``.

vLLM finds it through the ``vllm.general_plugins`` entry point this package declares:
``register`` runs in every vLLM process (the engine core and its workers are spawned, so
registering in the user's process alone would not be seen) and registers the engine
lazily, by module path, so that nothing heavy is imported until a worker creates it.
See ``receiver/vllm/backend.py`` for the backend (vLLM's weight-transfer engine) and ``layout.py`` for the runtime map.
"""

from __future__ import annotations

BACKEND = "weightsync"


def register() -> None:
    """The plugin entry point: idempotent, and a no-op without vLLM."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    _enable_amx()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "receiver.vllm.backend", "WeightsyncEngine")


def _enable_amx() -> None:
    """Ask Linux for the AMX tile state in this process, where the CPU has it.

    vLLM's CPU attention takes its AMX kernel wherever torch reports AMX tiles (bf16, block
    sizes of 32), but nothing in vLLM asks the kernel for the tile state first, which Linux
    requires of every process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``): the worker then dies of
    SIGILL (exit -4) at its first forward pass. torch's own call does the asking; on hosts
    without AMX it does nothing."""
    import torch

    init = getattr(torch._C._cpu, "_init_amx", None)
    if init is not None and torch.cpu._is_amx_tile_supported():
        init()
