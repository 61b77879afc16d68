"""The updates the benchmark syncs: real AdamW steps and synthetic ulp changes.

A workload owns the trainer's state (what ``Sender.start``/``sync`` get), makes fresh
receiver-side states of the same keys and shapes, and advances one step in place.

* ``RealWorkload``: ``examples.tiny_model.TinyLM`` at a configurable size, fp32 master
  weights trained with AdamW on its next-token task; receivers in bf16 (sparse changes)
  or fp32 (every element changes). The first step is excluded from the figures (AdamW's
  first update moves every weight by about ``lr``).
  Every workload syncs one unmeasured step first (it also pays one-time costs such as
  JIT compilation); those figures are kept under ``warmup`` in the result.
  A workload's ``patch`` options go over the run's for its patch path: the quick suite's
  ``real-bf16-lr1e-6-device`` is ``real-bf16-lr1e-6`` with ``patch.codec: device`` (the
  device compare and codec on CPU tensors, beside the host codec's row; it need not win, so
  its targets are reported but not counted: ``counted``).
* ``SyntheticWorkload``: a state dict of bf16 tensors (the trainer's dtype equals the
  receivers'); each step moves a random fraction ``density`` of the elements by +-1..3
  ulp (random sign; magnitudes 1/2/3 with probabilities 0.7/0.2/0.1), by adding to the
  int16 bit pattern in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from examples.tiny_model import TinyLM, train_step
from protocol.state import StateLike, resolve_state

ULP_MAGNITUDES = (1, 2, 3)
ULP_PROBS = (0.7, 0.2, 0.1)


def cast_state(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` (always a new tensor), others cloned."""
    return {k: (t.detach().to(dtype, copy=True) if t.is_floating_point() else t.detach().clone()) for k, t in tensors.items()}


@dataclass
class Workload:
    name: str
    kind: str  # "real" or "synthetic"
    receiver_dtype: torch.dtype
    warmup_steps: int  # steps synced but not measured
    measured_steps: int
    params: dict[str, Any] = field(default_factory=dict)
    patch: dict[str, Any] = field(default_factory=dict)  # patch options for this workload, over the run's
    counted: bool = True  # its targets count in the suite's passed/failed (else reported apart)

    # -- implemented by subclasses -----------------------------------------------------
    def setup(self) -> None:
        """Build the trainer's state (kept out of ``__init__`` so a suite lists its
        workloads without holding every model at once)."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Drop the trainer's state (a suite runs its workloads one after another)."""
        for name in ("model", "optimizer", "state"):
            if hasattr(self, name):
                delattr(self, name)

    def trainer_state(self) -> StateLike:
        raise NotImplementedError

    def receiver_state(self, seed: int) -> StateLike:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def receiver_spec(self) -> dict[str, Any]:
        """JSON that ``build_receiver_state`` turns into a fresh receiver state in another process."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------
    def tracked(self) -> dict[str, torch.Tensor]:
        """The tensors the library tracks (trainable + persistent buffers), each storage once."""
        state = resolve_state(self.trainer_state())
        return {k: state.tensors[k] for k in state.tracked if k not in state.aliases}

    def receiver_view(self) -> dict[str, torch.Tensor]:
        """A copy of the tracked tensors at the receivers' dtype: what they hold after a sync."""
        return cast_state(self.tracked(), self.receiver_dtype)

    def describe(self) -> dict[str, Any]:
        tracked = self.tracked()
        return {
            "kind": self.kind,
            "receiver_dtype": str(self.receiver_dtype).removeprefix("torch."),
            "trainer_dtype": sorted({str(t.dtype).removeprefix("torch.") for t in tracked.values() if t.is_floating_point()}),
            "tensors": len(tracked),
            "elements": sum(t.numel() for t in tracked.values()),
            **self.params,
        }


class RealWorkload(Workload):
    def __init__(self, name: str, receiver_dtype: torch.dtype, lr: float, model: dict[str, int], measured_steps: int, batch: int = 8,
                 patch: dict[str, Any] | None = None, counted: bool = True):
        params = {"lr": lr, "model": dict(model), "batch": batch, "optimizer": "AdamW", **({"patch": dict(patch)} if patch else {})}
        super().__init__(name, "real", receiver_dtype, 1, measured_steps, params, dict(patch or {}), counted)
        self.model_kw = dict(model)
        self.lr, self.batch = lr, batch
        self.last_loss: float | None = None

    def setup(self) -> None:
        torch.manual_seed(0)
        self.model = TinyLM(**self.model_kw)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        self.generator = torch.Generator().manual_seed(1234)

    def trainer_state(self) -> StateLike:
        return self.model

    def receiver_state(self, seed: int) -> StateLike:
        torch.manual_seed(seed)
        return TinyLM(**self.model_kw).to(self.receiver_dtype)

    def step(self) -> None:
        self.last_loss = train_step(self.model, self.optimizer, self.generator, batch=self.batch)

    def receiver_spec(self) -> dict[str, Any]:
        return {"kind": "real", "model": self.model_kw, "dtype": str(self.receiver_dtype).removeprefix("torch.")}


class SyntheticWorkload(Workload):
    def __init__(self, name: str, density: float, shapes: list[tuple[int, ...]], measured_steps: int, seed: int = 0):
        super().__init__(name, "synthetic", torch.bfloat16, 1, measured_steps, {
            "nominal_density": density, "shapes": [list(s) for s in shapes],
            "ulp_magnitudes": list(ULP_MAGNITUDES), "ulp_probabilities": list(ULP_PROBS),
        })
        self.density, self.shapes, self.seed = density, shapes, seed

    def setup(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)
        self.state = {
            f"layer{i}.weight": (torch.randn(shape, generator=self.generator) * 0.02).to(torch.bfloat16)
            for i, shape in enumerate(self.shapes)
        }

    def trainer_state(self) -> StateLike:
        return self.state

    def receiver_state(self, seed: int) -> StateLike:
        return {k: torch.zeros_like(t) for k, t in self.state.items()}

    def step(self) -> None:
        for t in self.state.values():
            perturb_ulps(t, self.density, self.generator)

    def receiver_spec(self) -> dict[str, Any]:
        return {"kind": "synthetic", "shapes": {k: list(t.shape) for k, t in self.state.items()}, "dtype": "bfloat16"}


def build_receiver_state(spec: dict[str, Any]) -> StateLike:
    """A receiver's starting state from ``Workload.receiver_spec`` (its values are
    irrelevant: the bootstrap overwrites them)."""
    dtype = getattr(torch, spec["dtype"])
    if spec["kind"] == "real":
        return TinyLM(**spec["model"]).to(dtype)
    if spec["kind"] == "qwen2":  # benchmarks/gpu_check.py e2e: built at its dtype on its device
        from .qwen2 import Qwen2Shaped, Shape

        return Qwen2Shaped(Shape(**spec["shape"]), device=spec.get("device", "cpu"), dtype=dtype)
    return {k: torch.zeros(shape, dtype=dtype) for k, shape in spec["shapes"].items()}


def ulp_steps(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` signed ulp steps: sign +-1 evenly, magnitude 1/2/3 with ``ULP_PROBS``."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int16)
    magnitude = torch.multinomial(torch.tensor(ULP_PROBS), n, replacement=True, generator=generator) + 1
    sign = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    return (magnitude * sign).to(torch.int16)


def perturb_ulps(t: torch.Tensor, density: float, generator: torch.Generator) -> int:
    """Move a random fraction ``density`` of the bf16 tensor ``t``'s elements by +-1..3
    ulp, in place (on the int16 bit pattern). Returns how many moved."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"expected a bf16 tensor, got {t.dtype}")
    bits = t.view(-1).view(torch.int16)
    flat = torch.nonzero(torch.rand(bits.shape, generator=generator) < density).squeeze(1)
    bits[flat] += ulp_steps(flat.numel(), generator)
    return flat.numel()


@dataclass(frozen=True)
class Suite:
    name: str
    model: dict[str, int]
    real_measured_steps: int
    synthetic_shapes: list[tuple[int, ...]]
    synthetic_measured_steps: int
    fp32_measured_steps: int | None = None  # the fp32-receiver case (every element changes): None = real_measured_steps
    densities: tuple[float, ...] = (0.001, 0.01, 0.03, 0.10, 0.30)
    copy_bytes: int = 256 << 20
    zmq_bytes: int = 64 << 20
    zmq_frame: int = 4 << 20
    memory_pass: bool = True
    device_codec_row: bool = False  # real-bf16-lr1e-6 again with patch.codec: device


SUITES = {
    # ~8.4M parameters (17 MB in bf16); 8.4M synthetic bf16 elements.
    "quick": Suite(
        "quick",
        model={"vocab": 8192, "dim": 256, "heads": 4, "layers": 8, "context": 64},
        real_measured_steps=3,
        fp32_measured_steps=2,
        synthetic_shapes=[(1024, 2048)] * 4 + [(2048,)],
        synthetic_measured_steps=3,
        copy_bytes=128 << 20,
        device_codec_row=True,
    ),
    # ~69M parameters (139 MB in bf16); 64M synthetic bf16 elements.
    "full": Suite(
        "full",
        model={"vocab": 16384, "dim": 768, "heads": 12, "layers": 8, "context": 64},
        real_measured_steps=4,
        synthetic_shapes=[(4096, 2048)] * 8 + [(4096,)],
        synthetic_measured_steps=3,
        copy_bytes=512 << 20,
        zmq_bytes=256 << 20,
    ),
}


def workloads(suite: Suite) -> list[Workload]:
    out: list[Workload] = [
        RealWorkload("real-bf16-lr1e-6", torch.bfloat16, 1e-6, suite.model, suite.real_measured_steps),
        *([RealWorkload("real-bf16-lr1e-6-device", torch.bfloat16, 1e-6, suite.model, suite.real_measured_steps,
                        patch={"codec": "device"}, counted=False)] if suite.device_codec_row else []),
        RealWorkload("real-bf16-lr1e-5", torch.bfloat16, 1e-5, suite.model, suite.real_measured_steps),
        RealWorkload("real-fp32-lr1e-5", torch.float32, 1e-5, suite.model, suite.fp32_measured_steps or suite.real_measured_steps),
    ]
    for d in suite.densities:
        out.append(SyntheticWorkload(f"synthetic-{100 * d:g}%", d, suite.synthetic_shapes, suite.synthetic_measured_steps))
    return out
