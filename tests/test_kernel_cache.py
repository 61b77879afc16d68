"""protocol/codec/kernel_cache.py: numba's cached codec kernels are dropped whenever any
of the sources whose kernels use each other's changed (numba itself only notices a
kernel's own file changing), and kept otherwise."""

from __future__ import annotations

import stat
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


@pytest.mark.skipif(not hasattr(stat, "S_IREAD"), reason="no file modes")
def test_a_read_only_cache_is_left_as_it_is(tmp_path: Path) -> None:
    d = tree(tmp_path)
    cached(d)
    cache = d / "__pycache__"
    cache.chmod(stat.S_IREAD | stat.S_IEXEC)
    try:
        kernel_cache.drop_stale(d)  # no error; root may still write here
    finally:
        cache.chmod(stat.S_IRWXU)


def test_the_installed_codec_is_stamped_with_its_sources() -> None:
    stamp = kernel_cache.HERE / "__pycache__" / kernel_cache.STAMP
    if stamp.exists():  # written on import, unless the install is read-only
        assert stamp.read_text() == kernel_cache.digest()
