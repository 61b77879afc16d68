"""Device-coded entries judged and staged as the receiver does (``stage_coded``,
receiver/apply/stage_device.py), for tests that decode entries themselves.

A device-coded entry decodes with its verdict unread; the receiver reads a batch's
verdicts, and every group's cut points, in one host sync before it stages anything of it.
``stage_decoded`` runs that on decoded entries against stand-ins of the tensors they update:
``IntegrityError`` for a payload whose checksum fails, else ``ProtocolError`` for one the
decoder refused, naming the first, before anything is staged; else each entry's updates
(its tensors' positions and new values)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from protocol.codec.tensorcodec import DecodedTensor
from protocol.wire.metadata import ModelMetadata
from protocol.wire.span import Span
from receiver.apply.commit import StagedUpdate
from receiver.apply.stage_device import Coded, stage_coded

Entry = tuple[DecodedTensor, tuple[int, ...], Span | None]  # decoded, its group (() alone), its span


def stage_decoded(entries: Sequence[Entry], olds: Mapping[int, torch.Tensor]) -> list[list[StagedUpdate]]:
    """``entries`` (device-coded, decoded) staged against ``olds`` (a tensor's values by its
    ordinal: every tensor an entry updates; only read), one batch a decode."""
    size = max(olds, default=-1) + 1
    model = {f"t{k}": olds.get(k, torch.empty(0)) for k in range(size)}
    metadata = ModelMetadata.of(model)
    return stage_coded([Coded.of(d, group, span, metadata) for d, group, span in entries], list(model.values()), metadata)


def judged(decoded: Sequence[DecodedTensor], targets: Mapping[int, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """The verdicts of the device-coded ones of ``decoded`` (lone tensors, each of the shape
    and dtype ``targets`` gives for its ordinal) read as the receiver reads them, against
    zeroed stand-ins of their tensors."""
    coded = [d for d in decoded if d.verdict is not None]
    stage_decoded([(d, (), None) for d in coded], {d.key: torch.zeros(targets[d.key][0], dtype=targets[d.key][1]) for d in coded})
