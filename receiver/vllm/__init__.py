"""weightsync as a vLLM weight-transfer backend, named ``weightsync``.

vLLM finds it through the ``vllm.general_plugins`` entry point this package declares:
``register`` runs in every vLLM process (the engine core and its workers are spawned, so
registering in the user's process alone would not be seen) and registers the engine
lazily, by module path, so that nothing heavy is imported until a worker creates it.
See ``receiver/vllm/engine.py`` for the engine and ``layout.py`` for the runtime map.
"""

from __future__ import annotations

BACKEND = "weightsync"


def register() -> None:
    """The plugin entry point: idempotent, and a no-op without vLLM."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "receiver.vllm.engine", "WeightsyncEngine")
