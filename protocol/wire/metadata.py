"""Receiver metadata: ordered keys, shapes and the receiver's own dtypes.

The receiver sends it in HELLO; the sender checks it against its model and uses the
receiver's key order as the tensor ordinals of every later message, and the receiver's
dtypes for its snapshot and bootstrap casts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from protocol.errors import MetadataMismatchError, ProtocolError
from protocol.wire.dtypes import dtype_code, dtype_from_code
from protocol.wire.framing import MAX_DIMS


@dataclass(frozen=True)
class ModelMetadata:
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> ModelMetadata:
        keys = tuple(tensors)
        return cls(keys, tuple(tuple(tensors[k].shape) for k in keys), tuple(tensors[k].dtype for k in keys))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {k: i for i, k in enumerate(self.keys)})

    def ordinal(self, key: str) -> int:
        return self._index[key]  # type: ignore[attr-defined]

    def __contains__(self, key: str) -> bool:
        return key in self._index  # type: ignore[attr-defined]

    def to_body(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "shapes": [list(s) for s in self.shapes], "dtypes": [dtype_code(d) for d in self.dtypes]}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ModelMetadata:
        """Metadata from an untrusted HELLO body."""
        keys, shapes, dtypes = body.get("keys"), body.get("shapes"), body.get("dtypes")
        if not (isinstance(keys, list) and isinstance(shapes, list) and isinstance(dtypes, list)):
            raise ProtocolError("metadata needs lists 'keys', 'shapes' and 'dtypes'")
        if not len(keys) == len(shapes) == len(dtypes):
            raise ProtocolError(f"metadata lists differ in length: {len(keys)} keys, {len(shapes)} shapes, {len(dtypes)} dtypes")
        if any(type(k) is not str for k in keys) or len(set(keys)) != len(keys):
            raise ProtocolError("metadata keys must be unique strings")
        for k, s in zip(keys, shapes):
            if not isinstance(s, list) or len(s) > MAX_DIMS or any(type(d) is not int or d < 0 for d in s):
                raise ProtocolError(f"metadata shape of {k!r} is malformed: {s!r:.80}")
        return cls(tuple(keys), tuple(tuple(s) for s in shapes), tuple(dtype_from_code(d) for d in dtypes))

    def check_against(self, tensors: Mapping[str, torch.Tensor], keys: Iterable[str] | None = None) -> None:
        """Raise ``MetadataMismatchError`` naming the first key missing on either side or
        differing in shape. ``keys`` limits the check to the sender keys that will travel."""
        sender_keys = list(tensors) if keys is None else list(keys)
        for k in sender_keys:
            if k not in self:
                raise MetadataMismatchError(f"key {k!r} exists on the sender but not on the receiver")
            shape = tuple(tensors[k].shape)
            if self.shapes[self.ordinal(k)] != shape:
                raise MetadataMismatchError(
                    f"key {k!r}: sender shape {list(shape)}, receiver shape {list(self.shapes[self.ordinal(k)])}"
                )
            if tensors[k].dtype.is_floating_point != self.dtypes[self.ordinal(k)].is_floating_point:
                raise MetadataMismatchError(
                    f"key {k!r}: sender dtype {tensors[k].dtype} cannot convert to receiver dtype {self.dtypes[self.ordinal(k)]}"
                )
        if keys is None:
            for k in self.keys:
                if k not in tensors:
                    raise MetadataMismatchError(f"key {k!r} exists on the receiver but not on the sender")

    def require_same(self, theirs: ModelMetadata, ours_are: str) -> None:
        """Raise ``MetadataMismatchError`` unless ``theirs`` equals this metadata exactly
        (keys, order, shapes, dtypes): later receivers of a sender, and a relay's receivers,
        share the wire's ordinals and dtypes. ``ours_are`` names whose metadata this is."""
        if theirs == self:
            return
        same = "every receiver of one sender holds the same keys, in one order, with the same shapes and dtypes"
        for key, shape, dtype in zip(theirs.keys, theirs.shapes, theirs.dtypes):
            if key not in self:
                raise MetadataMismatchError(f"key {key!r}: this receiver has it; {ours_are} do not ({same})")
            want_shape, want_dtype = self.shapes[self.ordinal(key)], self.dtypes[self.ordinal(key)]
            if want_shape != shape or want_dtype != dtype:
                formats = (dtype.itemsize == 1) != (want_dtype.itemsize == 1) and dtype.is_floating_point and want_dtype.is_floating_point
                why = "one sender serves one weight format, fp8 or not: run one sender per format" if formats else same
                raise MetadataMismatchError(
                    f"key {key!r}: this receiver holds {list(shape)} {dtype}; {ours_are}: {list(want_shape)} {want_dtype} "
                    f"(the trainer's shape: {list(want_shape)}; {why})"
                )
        missing = next((k for k in self.keys if k not in theirs), None)
        if missing is not None:
            raise MetadataMismatchError(f"key {missing!r}: this receiver does not have it; {ours_are} do ({same})")
        raise MetadataMismatchError(f"this receiver's keys are in another order than those of {ours_are} ({same})")
