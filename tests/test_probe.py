"""The probe map (``sender/sharded/probe.py``) against exports written here, in a one-rank gloo
group: what a bridge does to parameters on its way to checkpoint tensors (fused tensors split,
a column block, rows of several parameters) is mapped exactly, and what it does that the map
cannot carry (a transpose, a shift, arithmetic, a cast that loses codes, values from nowhere,
a conversion that only touches real weights) is refused with a ``ConfigError`` naming it.
The multi-rank behaviour (owners of replicated parameters, every rank raising together) runs
on real Megatron ranks: ``tests/test_megatron_sync.py``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from protocol.errors import ConfigError
from protocol.wire.span import Span
from sender.sharded.probe import fold, probe, verify

Params = list[tuple[str, torch.Tensor]]


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    if dist.is_initialized():  # another module's group: use it
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def params() -> Params:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.nn.Parameter(torch.randn(64, 8, generator=g))),  # 512 elements first: later codes pass 2**8
        ("qkv", torch.nn.Parameter(torch.randn(6, 4, generator=g))),  # q: rows 0-3, k: 4, v: 5
        ("left", torch.nn.Parameter(torch.randn(4, 2, generator=g))),  # the left columns of a [4, 4] o_proj
        ("right", torch.nn.Parameter(torch.randn(4, 2, generator=g))),  # its right columns
        ("norm", torch.nn.Parameter(torch.randn(4, generator=g))),
    ]


Export = Callable[[], Iterator[tuple[str, torch.Tensor]]]


def bridge(ps: Params, transform: Callable[[str, torch.Tensor], torch.Tensor] = lambda n, t: t, *, twice: bool = False) -> Export:
    """A bridge's export of ``ps``: qkv split into q/k/v, o_proj made of two column blocks (or,
    ``twice``, of norm's elements in two columns beside ``right``), then ``transform`` of each."""
    named = dict(ps)

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        qkv, left, right, norm = (named[n].detach() for n in ("qkv", "left", "right", "norm"))
        out = {
            "embed": named["embed"].detach(),
            "q_proj": qkv[:4], "k_proj": qkv[4:5], "v_proj": qkv[5:6],
            "o_proj": torch.cat([torch.stack([norm, norm], 1) if twice else left, right], 1),
            "norm": norm,
        }
        for name, t in out.items():
            yield name, transform(name, t.clone())

    return export


def test_splits_and_column_blocks_map_exactly_and_verify() -> None:
    ps = [*params()]
    found = probe(ps, bridge(ps))
    got = {(x.tensor, x.param): (x.local, x.span) for x in found}
    assert got == {
        ("embed", "embed"): (Span(0, 512), Span(0, 512)),
        ("q_proj", "qkv"): (Span(0, 16), Span(0, 16)),
        ("k_proj", "qkv"): (Span(16, 4), Span(0, 4)),
        ("v_proj", "qkv"): (Span(20, 4), Span(0, 4)),
        ("o_proj", "left"): (Span(0, 8), Span(0, 2, 4, 4)),  # column blocks: strided in o_proj
        ("o_proj", "right"): (Span(0, 8), Span(2, 2, 4, 4)),
        ("norm", "norm"): (Span(0, 4), Span(0, 4)),
    }
    metas = verify(ps, found, bridge(ps)())
    shapes = {"embed": (64, 8), "q_proj": (4, 4), "k_proj": (1, 4), "v_proj": (1, 4), "o_proj": (4, 4), "norm": (4,)}
    assert {n: tuple(t.shape) for n, t in metas.items()} == shapes
    assert all(t.device.type == "meta" for t in metas.values())


def test_a_parameter_landing_twice_in_one_tensor_is_refused() -> None:
    """norm feeds two columns of o_proj: element i lands at 4i and 4i + 1, no one strided
    block in local order: refused, naming the pair (left lands nowhere: that is allowed)."""
    ps = params()
    with pytest.raises(ConfigError, match=r"'norm' in 'o_proj'.*one strided block"):
        probe(ps, bridge(ps, twice=True))


@pytest.mark.parametrize(
    ("transform", "match"),
    [
        (lambda n, t: t.T.contiguous() if n == "q_proj" else t, r"'qkv' in 'q_proj'.*strided block"),  # a transpose
        (lambda n, t: t + 1 if n == "k_proj" else t, r"\['k_proj'\]: two probes disagree"),  # moved and shifted
        (lambda n, t: t * 0.5 if n == "v_proj" else t, r"computes on the values of 'v_proj'"),  # arithmetic
        (lambda n, t: t.to(torch.bfloat16) if n == "norm" else t, r"'norm' in torch.bfloat16: probe codes up to \d+ are not exact"),
        (lambda n, t: torch.zeros_like(t) if n == "k_proj" else t, r"4 elements of the export's 'k_proj' come from no parameter"),
    ],
    ids=["transpose", "shift", "arithmetic", "lossy-cast", "from-nowhere"],
)
def test_what_the_map_cannot_carry_is_refused(transform: Callable[[str, torch.Tensor], torch.Tensor], match: str) -> None:
    ps = params()
    before = {n: p.detach().clone() for n, p in ps}
    with pytest.raises(ConfigError, match=match):
        probe(ps, bridge(ps, transform))
    for n, p in ps:  # the probe put every parameter's values back
        assert p.dtype == before[n].dtype and torch.equal(p.detach(), before[n])


def test_a_conversion_that_only_touches_real_weights_is_caught_by_verify() -> None:
    ps = params()

    def touch(name: str, t: torch.Tensor) -> torch.Tensor:  # codes pass, weights do not
        return t * 1.5 if name == "k_proj" and not torch.equal(t, t.round()) else t

    found = probe(ps, bridge(ps, touch))
    with pytest.raises(ConfigError, match=r"'qkv' does not equal its place in the export's 'k_proj'"):
        verify(ps, found, bridge(ps, touch)())


def test_fold_makes_one_form_per_block() -> None:
    # runs end to end on both sides: one run
    assert fold(torch.arange(8), torch.arange(10, 18), "x") == (Span(0, 8), Span(10, 8))
    # a column block: local contiguous, checkpoint strided
    local, span = fold(torch.arange(8), torch.tensor([2, 3, 8, 9, 14, 15, 20, 21]), "x")
    assert (local, span) == (Span(0, 8), Span(2, 2, 4, 6))
    # interleaved groups: local strided, checkpoint contiguous
    assert fold(torch.tensor([0, 1, 4, 5]), torch.arange(4), "x") == (Span(0, 2, 2, 4), Span(0, 4))
    # unequal runs, or a descending checkpoint side: refused
    with pytest.raises(ConfigError, match="one strided block"):
        fold(torch.arange(5), torch.tensor([0, 1, 5, 6, 7]), "x")
    with pytest.raises(ConfigError, match="one strided block"):
        fold(torch.arange(4), torch.tensor([6, 7, 0, 1]), "x")
