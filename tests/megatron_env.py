"""The Megatron test environment's shims, all of them, in one place (``make megatron-env``).

megatron-core 0.19.2 and Megatron-Bridge 0.6.2 are built for CUDA hosts with Transformer Engine and
Python >= 3.12; the tests run them on CPU with gloo under Python 3.11. Each line below is a packaging
or device-placement workaround, and says why. None stands in for Megatron's layers, its parallel
layouts or the bridge's conversions: those run as shipped.

``install()`` is idempotent; call it in every process (spawned ranks too) before importing
``megatron.bridge``. ``tensor_cuda_noop()`` is the one shim scoped to a block (model building).
``require_megatron(__file__)`` skips a test module where the packages are absent.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

_installed = False


def install() -> None:
    """Apply the shims in this process (the order matters: see the comments)."""
    global _installed
    if _installed:
        return
    import typing

    import typing_extensions

    # megatron.training (imported by the bridge) does `from typing import override` (3.12+).
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override  # type: ignore[attr-defined]

    # megatron.core and megatron.training probe `import transformer_engine` to pick their layer
    # specs (HAVE_TE). They must see it absent, so they are imported BEFORE the stub below exists:
    # megatron.training imports megatron.core.models.hybrid.hybrid_layer_specs, which asks TE's
    # version when HAVE_TE is true.
    import megatron.core
    import megatron.training  # noqa: F401
    import torch

    # Megatron-Bridge's peft/lora_layers.py does `import transformer_engine.pytorch as te` at module
    # level, unconditionally, and uses `te.ops.Sequential` in return annotations (evaluated when the
    # module loads). The stub has just that; any real use raises. LoRA is not used by these tests.
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        te = types.ModuleType("transformer_engine")
        te.__path__ = []  # a package, so `transformer_engine.pytorch` resolves
        te_pytorch = types.ModuleType("transformer_engine.pytorch")

        class _Absent:
            def __init__(self, *args: object, **kwargs: object) -> None:
                raise RuntimeError("transformer_engine is not installed (stub from tests/megatron_env.py)")

        te_pytorch.ops = types.SimpleNamespace(Sequential=_Absent)  # type: ignore[attr-defined]
        te.pytorch = te_pytorch  # type: ignore[attr-defined]
        sys.modules["transformer_engine"] = te
        sys.modules["transformer_engine.pytorch"] = te_pytorch

    # The bridge's provide_distributed_model calls model.cuda() after building on CPU
    # (use_cpu_initialization=True); on a CPU-only torch that raises. The modules stay where built.
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]

    # Megatron's rotary embedding places its inv_freq on torch.cuda.current_device(); "cpu" is the
    # device the model lives on here. Nothing else in these tests asks for the current CUDA device.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    _installed = True


@contextlib.contextmanager
def tensor_cuda_noop() -> Iterator[None]:
    """``torch.Tensor.cuda`` as a no-op, only while a model is built: with tied embeddings split
    across pipeline stages, Megatron's ``LanguageModule.setup_embeddings_and_output_layer`` does
    ``weight.data = weight.data.cuda()`` before all-reducing the two copies (the last stage's starts
    at 0). Scoped, not global, so no other ``.cuda()`` of a tensor is hidden."""
    import torch

    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = saved  # type: ignore[method-assign]


def require_megatron(test_file: str) -> None:
    """Call at the top of a test module, before importing Megatron; skips the whole module."""
    import pytest

    try:
        install()
        import megatron.bridge  # noqa: F401
    except Exception as exc:  # ImportError, or a packaging fault raised while the packages import
        name = Path(test_file).name
        pytest.skip(
            f"megatron-core / megatron-bridge are not importable here ({type(exc).__name__}: {exc}); "
            f"build them with `make megatron-env` and run `.venv-megatron/bin/python -m pytest tests/{name}`",
            allow_module_level=True,
        )
