#!/usr/bin/env python3
"""The kernel cache of one or more source trees packed for a device call, so the lent machine loads
cubins instead of compiling them (about a minute a tree there, out of the session's device time).

    python scripts/kernel_cache_pack.py --out .kcache.tar.xz [--nvrtc 13.0] [--arch sm_90a] TREE [TREE ...]
    python3 scripts/kernel_cache_pack.py --unpack .kcache.tar.xz      (on the device: prints the folder)

Each TREE (a folder holding cupymoe/ and cuda/: `.`, `.old`, an exported experiment) is built by
`python -P -m cupymoe kernels --arch ARCH` into one scratch cache (CUPYMOE_CACHE_DIR), which is
written as a .tar.xz (carry it). A cache key holds the NVRTC version, so the Python running the pack
must have the device's NVRTC (`python -m cupymoe kernels` prints it there; 13.0 in the device image:
a venv with cupy-cuda13x and cuda-toolkit[nvrtc]==13.0.* gives it); the pack refuses, naming both,
where they differ. On the device a script unpacks first and keeps the folder for every later step
(device_check.sh, gpu_tests.sh and trees_bench.sh do: `source scripts/kernel_cache_env.sh`).

A module whose key does not match (another source, knob or NVRTC) is compiled there as before.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


class PackError(RuntimeError):
    """The pack cannot make a cache the device would read."""


def local_nvrtc(python: str = sys.executable) -> str:
    """The NVRTC version `python`'s CuPy compiles with, as "major.minor"."""
    out = subprocess.run([python, "-c", "from cupy.cuda import nvrtc; print('%d.%d' % nvrtc.getVersion())"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise PackError(f"{python} cannot report its NVRTC version (is CuPy installed?): {out.stderr.strip()[-300:]}")
    return out.stdout.strip()


def check_nvrtc(found: str, wanted: str) -> None:
    if found != wanted:
        raise PackError(f"this Python's NVRTC is {found}, the device's is {wanted}: the cache keys would not match; "
                        f"run the pack from an environment with NVRTC {wanted} (or pass --nvrtc {found} if the "
                        f"device has it)")


def build(trees: list[Path], arch: str, cache: Path) -> None:
    """Every module of each tree for `arch` into `cache`."""
    for tree in trees:
        if not (tree / "cupymoe").is_dir() or not (tree / "cuda").is_dir():
            raise PackError(f"{tree}: not a source tree (no cupymoe/ and cuda/ in it)")
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()), CUPYMOE_CACHE_DIR=str(cache))
        run = subprocess.run([sys.executable, "-P", "-m", "cupymoe", "kernels", "--arch", arch], env=env,
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise PackError(f"{tree}: `python -m cupymoe kernels --arch {arch}` failed (rc {run.returncode}): "
                            f"{(run.stdout + run.stderr).strip()[-600:]}")
        print(f"{tree}: built into the cache", file=sys.stderr)


def pack(cache: Path, out: Path) -> int:
    files = sorted(p for p in cache.iterdir() if p.is_file())
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    return len(files)


def unpack(archive: Path, into: Path) -> int:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and "/" not in m.name and not m.name.startswith(".")]
        tar.extractall(into, members=members, filter="data")
    return len(members)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", type=Path, help="source trees to build (pack mode)")
    ap.add_argument("--out", type=Path, help="the archive to write (pack mode)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--nvrtc", default="13.0", help="the device's NVRTC version (default 13.0)")
    ap.add_argument("--unpack", type=Path, metavar="ARCHIVE", help="unpack ARCHIVE and print the cache folder")
    ap.add_argument("--into", type=Path, help="where --unpack writes (default: a new temporary folder)")
    args = ap.parse_args(argv)
    try:
        if args.unpack:
            into = args.into or Path(tempfile.mkdtemp(prefix="cupymoe-kcache-"))
            n = unpack(args.unpack, into)
            print(f"{args.unpack}: {n} cache files into {into}", file=sys.stderr)
            print(into)
            return 0
        if not args.trees or args.out is None:
            ap.error("pack mode takes --out ARCHIVE and at least one TREE")
        check_nvrtc(local_nvrtc(), args.nvrtc)
        with tempfile.TemporaryDirectory(prefix="cupymoe-kcache-") as d:
            build(args.trees, args.arch, Path(d))
            n = pack(Path(d), args.out)
        print(f"{args.out}: {n} cache files, {args.out.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
        return 0
    except PackError as e:
        print(f"kernel_cache_pack: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
