"""A vLLM worker extension: the weightsync backend's state by name, through ``collective_rpc``.

vLLM's own extension point for RL drivers (``worker_extension_cls``, mixed into every
worker class): start the engine with
``worker_extension_cls="receiver.vllm.extension.WeightsyncWorker"`` (``LLM(...)``,
``AsyncEngineArgs(...)``, or ``vllm serve --worker-extension-cls ...``) and call
``llm.collective_rpc("weightsync_versions")``, ``await engine.collective_rpc(...)`` or
``POST /collective_rpc {"method": "weightsync_versions"}`` (``VLLM_SERVER_DEV_MODE=1``):
one answer per worker, no pickled functions (``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off).
"""

from __future__ import annotations

from typing import Any


class WeightsyncWorker:
    """Mixed into vLLM's worker class; every name here is prefixed so as not to clash with it."""

    weight_transfer_engine: Any  # the worker's, set by vLLM at init_weight_transfer_engine

    def weightsync_versions(self) -> dict[str, Any]:
        """This worker's held version and which version each of its engine steps ran with
        (``receiver.held.steps.StepVersions.snapshot``): label ``finish_weight_update`` with
        the version every worker holds, and check vLLM's per-request spans against the runs.
        ``{"version": None, ...}`` before ``init_weight_transfer_engine``."""
        engine = getattr(self, "weight_transfer_engine", None)
        steps = getattr(engine, "step_versions", None)
        if steps is None:
            return {"version": None, "steps": 0, "runs": []}
        snapshot: dict[str, Any] = steps.snapshot()
        return snapshot
