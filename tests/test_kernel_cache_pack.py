"""scripts/kernel_cache_pack.py without a GPU or NVRTC: an NVRTC mismatch refused by name, a folder that is
not a source tree refused, and the archive's round trip (only plain top-level files come out)."""

import importlib.util
import io
import tarfile
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("kernel_cache_pack",
                                              Path(__file__).parent.parent / "scripts" / "kernel_cache_pack.py")
kernel_cache_pack = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(kernel_cache_pack)


def test_an_nvrtc_mismatch_is_refused_naming_both():
    kernel_cache_pack.check_nvrtc("13.0", "13.0")
    with pytest.raises(kernel_cache_pack.PackError, match=r"NVRTC is 12\.9, the device's is 13\.0"):
        kernel_cache_pack.check_nvrtc("12.9", "13.0")


def test_a_folder_without_sources_is_refused(tmp_path):
    with pytest.raises(kernel_cache_pack.PackError, match="not a source tree"):
        kernel_cache_pack.build([tmp_path], "sm_90a", tmp_path / "cache")


def test_pack_then_unpack_keeps_the_cache_files(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "router-sm_90a-0123.cubin").write_bytes(b"\x7fELF" + bytes(range(200)))
    (cache / "router-sm_90a-0123.json").write_text('{"key": "0123"}')
    archive = tmp_path / "k.tar.xz"
    assert kernel_cache_pack.pack(cache, archive) == 2
    into = tmp_path / "into"
    assert kernel_cache_pack.unpack(archive, into) == 2
    assert (into / "router-sm_90a-0123.cubin").read_bytes() == (cache / "router-sm_90a-0123.cubin").read_bytes()


def test_unpack_leaves_out_paths_and_hidden_names(tmp_path):
    archive = tmp_path / "bad.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for name in ("../escape.cubin", "sub/dir.cubin", ".hidden", "ok.json"):
            data = b"x"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    into = tmp_path / "into"
    assert kernel_cache_pack.unpack(archive, into) == 1
    assert sorted(p.name for p in into.iterdir()) == ["ok.json"]
    assert not (tmp_path / "escape.cubin").exists()
