"""protocol/codec/kernel_cache.py: numba's cached codec kernels are dropped whenever any
of the sources whose kernels use each other's changed (numba itself only notices a
kernel's own file changing), and kept otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protocol.codec import kernel_cache


def tree(tmp_path: Path) -> Path:
    for name in kernel_cache.SOURCES:
        (tmp_path / name).write_text(f"# {name}\n")
    (tmp_path / "__pycache__").mkdir()
    return tmp_path


def cached(directory: Path) -> None:
    for name in ("packed._encode-233.py311.nbi", "packed._encode-233.py311.1.nbc", "rans.encode_into-90.py311.nbi"):
        (directory / "__pycache__" / name).write_bytes(b"x")
    (directory / "__pycache__" / "packed.cpython-311.pyc").write_bytes(b"x")


def kernels(directory: Path) -> list[str]:
    return sorted(p.name for p in (directory / "__pycache__").iterdir() if p.suffix in (".nbi", ".nbc"))


def test_a_changed_source_drops_every_cached_kernel_once(tmp_path: Path) -> None:
    d = tree(tmp_path)
    cached(d)
    assert kernel_cache.drop_stale(d)  # no stamp yet: whatever is cached may be stale
    assert kernels(d) == [] and (d / "__pycache__" / "packed.cpython-311.pyc").exists()
    cached(d)
    assert not kernel_cache.drop_stale(d)  # the same sources: compiled kernels stay
    assert len(kernels(d)) == 3
    (d / "rans.py").write_text("# rans, changed\n")  # another file than packed's own
    assert kernel_cache.drop_stale(d)
    assert kernels(d) == []


def test_a_file_outside_the_sources_does_not_count(tmp_path: Path) -> None:
    d = tree(tmp_path)
    kernel_cache.drop_stale(d)
    cached(d)
    (d / "coo.py").write_text("# not a kernel source\n")
    assert not kernel_cache.drop_stale(d) and len(kernels(d)) == 3


def test_a_cache_that_cannot_be_written_is_left_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only install: removing a kernel or writing the stamp fails, and the import
    goes on (numba then compiles without caching, or uses its own cache directory)."""
    d = tree(tmp_path)
    cached(d)

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(f"read-only: {self}")

    monkeypatch.setattr(Path, "unlink", refuse)
    assert not kernel_cache.drop_stale(d)
    assert len(kernels(d)) == 3 and not (d / "__pycache__" / kernel_cache.STAMP).exists()


def test_the_installed_codec_is_stamped_with_its_sources() -> None:
    cache = kernel_cache.HERE / "__pycache__"
    if not os.access(cache if cache.exists() else kernel_cache.HERE, os.W_OK):
        pytest.skip("a read-only install: no stamp is written")
    assert (cache / kernel_cache.STAMP).read_text() == kernel_cache.digest()  # written when protocol.codec was imported
