"""Compiling and loading the cuda/ kernels: NVRTC through CuPy's bindings, one arch choice.

One compile path serves the runtime (a KernelLibrary loads cubins onto its device) and the
GPU-less build check (`python -m cupymoe kernels --arch sm_90a`): NVRTC compiles each module
for an explicit real architecture (sm_90a on Hopper, so wgmma is available) straight to a
cubin, every template instance named up front (MODULES). The arch is chosen here only:
CuPy's RawModule would add the device's own arch, which collides with ours.

Cubins are cached on disk keyed by the module source, every header, the options, the arch,
the names and the NVRTC version (CUPYMOE_CACHE_DIR, default ~/.cache/cupymoe). Writes are
atomic (temp file + rename): processes starting at once at worst compile twice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from . import catalog as C
from .catalog import GemmMode, WeightFormat
from .errors import CudaUnavailableError, KernelBuildError, OptionError
from .knobs import Knobs
from .tuning import TUNING

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModuleSpec:
    """One cuda/*.cu file and the kernels (template instances included) it provides."""

    file: str
    names: tuple[str, ...]
    archs: Optional[tuple[str, ...]] = None  # built only for these (None: every arch)

    def builds_for(self, arch: str) -> bool:
        return self.archs is None or arch in self.archs


def _grouped_names() -> tuple[str, ...]:
    cfg = TUNING.grouped_configs

    def name(mode, config, fmt=0):
        c = cfg[config]
        return C.grouped_kernel(mode, c.bm, c.bk, c.stages, fmt)[0]

    quant = [f for f in WeightFormat if f]
    return (("sort_count", "sort_scan", "sort_place", "make_tiles", "grouped_reduce")
            + tuple(name(GemmMode.ROUTER, c) for c in ("stream", "math"))
            + tuple(name(m, c) for m in (0, 1) for c in ("stream", "math"))
            + tuple(name(m, c, f) for m in (0, 1) for c in ("stream_q", "math") for f in quant)
            + tuple(C.lora_grouped_kernel(name(m, c, WeightFormat.FP8_BLOCK)) for m in (0, 1)
                    for c in ("stream_q", "math"))  # the stacked form on w8a16 (lora_stack.py)
            + tuple(C.lora_grouped_kernel(name(GemmMode.ROUTER, c)) for c in ("stream", "math")))  # LoRA t beside the logits


def _modules() -> dict[str, ModuleSpec]:
    V = TUNING.sm90_variants.values()
    fmts = list(WeightFormat)
    hopper = ("sm_90a",)
    return {
        "router": ModuleSpec("router.cu", tuple(f"router_logits_bf16<{r}, {sp}>" for r in C.ROW_TILES
                                                for sp in C.ROUTER_SPLITS) + ("rmsnorm_bf16",)
                             + tuple(f"router_logits_bf16_lora<1, {sp}>" for sp in C.ROUTER_SPLITS)),
        "router_mma": ModuleSpec("router_mma.cu", tuple(f"router_logits_mma<{nt}>" for nt in C.ROUTER_MMA_TILES)
                                 + tuple(f"router_logits_split<{nt}>" for nt in C.ROUTER_SPLIT_TILES),
                                 archs=hopper),
        "topk": ModuleSpec("topk.cu", ("topk_route<0>", "topk_route<1>", "experts_route_in",  # <1>: group-limited
                                       "topk_route_lora<0>", "topk_route_lora<1>", "experts_route_in_lora",
                                       "x_codes_e4m3")),
        "grouped": ModuleSpec("grouped.cu", _grouped_names()),
        "grouped_sm90": ModuleSpec("grouped_sm90.cu", tuple(dict.fromkeys(
            [v.kernel(m) for m in (0, 1, 2) for v in V if not v.tma]
            + [v.kernel(m, f) for m in (0, 1) for f in C.SM90_QUANT_FORMATS for v in V if v.serves(f)])),
                                   archs=hopper),
        "grouped_sm90_tma": ModuleSpec("grouped_sm90_tma.cu", tuple(dict.fromkeys(
            [v.kernel(m) for m in (0, 1) for v in V if v.tma] + [v.kernel_lora(m) for m in (0, 1) for v in V if v.tma]))
            + ("gather_rows",), archs=hopper),
        "grouped_sm90_fp8": ModuleSpec("grouped_sm90_fp8.cu", C.sm90_fp8_kernels(tma=False), archs=hopper),
        "grouped_sm90_fp8_tma": ModuleSpec("grouped_sm90_fp8_tma.cu", C.sm90_fp8_kernels(tma=True), archs=hopper),
        "decode": ModuleSpec(
            "decode.cu",
            tuple(f"decode_build_lists<{r}>" for r in range(1, C.LISTS_MAX_ROUNDS + 1))
            + ("decode_route_lists", "decode_topk_lists<0>", "decode_topk_lists<1>", "decode_reduce",
               "decode_route_lists_lora")
            + tuple(f"decode_gate_up<{r}, {c}, {int(f)}>" for f in fmts for r, c in C.GATE_UP_VARIANTS)
            + tuple(f"decode_down<{r}, {c}, {int(f)}>" for f in fmts for r, c in C.DOWN_VARIANTS)),
        "decode_mma": ModuleSpec(
            "decode_mma.cu",
            tuple(f"decode_mma_{m}<{int(f)}, {ks}, {nt}>" for m in ("gate_up", "down") for f in C.MMA_DECODE_FORMATS
                  for ks in C.MMA_DECODE_K_SPLITS for nt in C.MMA_DECODE_TOKEN_TILES)
            + tuple(f"decode_mma_down<{int(f)}, 1, {nt}, 2>" for f in C.MMA_DECODE_FORMATS
                    for nt in C.MMA_DECODE_TOKEN_TILES)),
        "decode_mma_a8": ModuleSpec(  # the same file's kernels on the activations' e4m3 codes
            "decode_mma.cu",
            tuple(f"decode_mma_{m}_a8<{ks}, {nt}>" for m in ("gate_up", "down")
                  for ks in C.MMA_DECODE_K_SPLITS for nt in C.MMA_DECODE_TOKEN_TILES)
            + tuple(f"decode_mma_down_a8<1, {nt}, 2>" for nt in C.MMA_DECODE_TOKEN_TILES), archs=hopper),
        "decode_wgmma_a8": ModuleSpec(
            "decode_wgmma_a8.cu", tuple(f"decode_wgmma_{m}_a8<{nt}>" for m in ("gate_up", "down")
                                        for nt in C.WGMMA_DECODE_TOKEN_TILES), archs=hopper),
        "decode_swapab_sm90": ModuleSpec(
            "decode_swapab_sm90.cu", tuple(f"decode_swapab_{m}<{nt}>" for m in ("gate_up", "down", "gate_up_lora")
                                           for nt in C.SWAPAB_TOKEN_TILES), archs=hopper),
        "decode_swapab_fp8_sm90": ModuleSpec(
            "decode_swapab_fp8_sm90.cu", tuple(f"decode_swapab_fp8_{m}<{nt}>" for m in ("gate_up", "down")
                                               for nt in C.SWAPAB_FP8_TOKEN_TILES), archs=hopper),
        "repack": ModuleSpec("repack.cu", ("fp4_repack_words",)),  # the fp4 device layout, made at load
        "lora": ModuleSpec("lora.cu", ("lora_router_delta", "lora_gate_up_act", "lora_gate_up_expand_act",
                                        "lora_down_delta",
                                        "lora_grouped_gate_up_act", "lora_grouped_down_delta",
                                        "lora_grouped_router_delta", "lora_stack_t_gate_up", "lora_stack_t_gate_up_runs",
                                        "lora_stack_t_down")
                           + tuple(f"lora_stack_t_seg{by}<{np_}, {bn}>" for by in ("", "_experts") for np_ in (2, 1)
                                   for bn in C.LORA_SEG_BNS)),  # LoRA (lora_slots.py, lora_stack.py)
        "decode_wgmma_fp4": ModuleSpec(
            "decode_wgmma_fp4.cu", tuple(f"decode_wgmma_{m}_fp4<{int(f)}, {nt}>" for m in ("gate_up", "down")
                                         for f in C.FP4_DECODE_FORMATS for nt in C.WGMMA_FP4_DECODE_TOKEN_TILES),
            archs=hopper),
    }


MODULES: dict[str, ModuleSpec] = _modules()


def kernel_dir() -> Path:
    """cuda/ of the source tree, or cupymoe/cuda/ of an installed package."""
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda", here.parent / "cuda"):
        if (cand / "common.cuh").is_file():
            return cand
    raise KernelBuildError(f"cupymoe kernels not found next to {here} (looked in cuda/ and ../cuda/)")


def cache_dir(knobs: Optional[Knobs] = None) -> Path:
    d = (knobs or Knobs.from_env()).cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "cupymoe")
    return Path(d)


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the install
        raise CudaUnavailableError("CuPy is not installed: install cupymoe with the cu12 or cu13 extra "
                                   "(pip install 'cupymoe[cu12]')") from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())  # type: ignore[return-value]


def cuda_include_dirs() -> list[str]:
    """Where cuda_bf16.h lives: NVIDIA's PyPI headers first, then a local toolkit."""
    dirs: list[str] = []
    try:
        import cuda.pathfinder as pf

        d = pf.find_nvidia_header_directory("cudart")
        if d:
            dirs.append(str(d))
    except Exception as e:  # pathfinder absent or no pip headers: try the toolkit
        log.debug("cuda.pathfinder found no cudart headers: %s", e)
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs.append("/usr/local/cuda/include")
    found = [d for d in dirs if os.path.isfile(os.path.join(d, "cuda_bf16.h"))]
    if not found:
        raise KernelBuildError("cuda_bf16.h not found: install the CUDA headers (pip install nvidia-cuda-runtime-cu12) "
                               f"or set CUDA_PATH; looked in {dirs}")
    return found[:1]


# NVIDIA's real architectures from Ampere on; `a` (arch-specific) from Hopper, `f` (family) from Blackwell: any
# other name up to the newest (sm_99, sm_80z) would print a plan for no GPU or fail inside NVRTC mid-build; past
# the newest, a GPU this list predates, NVRTC decides
REAL_ARCHS = (80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)
ARCH_SUFFIXES = {"": 80, "a": 90, "f": 100}  # suffix -> the first architecture that has it


def parse_arch(arch: str) -> tuple[int, str]:
    """'sm_90a' -> (90, 'sm_90a'). Real architectures only: the cubin is what loads."""
    m = re.fullmatch(r"sm_(\d+)([a-z]?)", arch) if isinstance(arch, str) else None
    if not m:
        raise OptionError(f"arch={arch!r}: expected a real architecture like sm_80 or sm_90a")
    cc, suffix = int(m.group(1)), m.group(2)
    if cc < 80:
        raise OptionError(f"arch={arch!r}: cupymoe needs sm_80 or newer (bf16 tensor cores, cp.async)")
    if (cc not in REAL_ARCHS and cc < REAL_ARCHS[-1]) or cc < ARCH_SUFFIXES.get(suffix, 10**9):
        raise OptionError(f"arch={arch!r}: no such GPU architecture; one of "
                          f"{', '.join(f'sm_{c}' for c in REAL_ARCHS)}, with 'a' from sm_90 and 'f' from sm_100")
    return cc, arch


def arch_for_capability(major: int, minor: int) -> str:
    """The arch we compile for on a device: Hopper gets sm_90a so wgmma is available."""
    cc = major * 10 + minor
    return "sm_90a" if cc == 90 else f"sm_{cc}"


def compile_options(arch: str, knobs: Optional[Knobs] = None) -> tuple[str, ...]:
    cc, arch = parse_arch(arch)
    knobs = knobs or Knobs.from_env()
    band, lanes, router_tpr = knobs.gemm_band_cols, knobs.lora_down_lanes, knobs.lora_router_tpr
    return (
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "-default-device",  # unannotated functions (the epilogues' lambdas) are device code
        "-lineinfo",
        f"-DCUPYMOE_SM={cc}",
        *((f"-DGEMM_BAND_COLS={band}",) if band else ()),
        *((f"-DLORA_DOWN_TPR={lanes[0]}", f"-DLORA_DOWN_VPT={lanes[1]}") if lanes else ()),
        *((f"-DLORA_ROUTER_TPR={router_tpr}",) if router_tpr else ()),
        f"-I{kernel_dir()}",
        *(f"-I{d}" for d in cuda_include_dirs()),
        "-Xptxas=-v",  # resource report in the program log (registers, spills, smem)
    )


@dataclass
class KernelResources:
    name: str  # the name expression, e.g. decode_gate_up<4, 1, 0>
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_bytes: int
    uses_wgmma: bool


@dataclass
class CompiledModule:
    module: str
    arch: str
    cubin: bytes
    ptx: str
    lowered: dict[str, str]  # name expression -> mangled name
    log: str
    from_cache: bool = False
    _resources: Optional[list[KernelResources]] = field(default=None, repr=False)

    def resources(self) -> list[KernelResources]:
        """Per-kernel registers, spills, static shared memory and wgmma use, from ptxas -v."""
        if self._resources is None:
            self._resources = _parse_resources(self.log, self.ptx, self.lowered)
        return self._resources


@functools.cache  # the imported sources do not change within a process
def tree_digest() -> str:
    """12 hex digits over the imported package's Python files, its data and its cuda/ kernels: which
    tree a result came from where commits read alike (a copy without .git, uncommitted changes, or a
    PYTHONPATH that `python -m` overrode with the working folder)."""
    pkg, kd = Path(__file__).resolve().parent, kernel_dir()
    files = [(f.relative_to(pkg).as_posix(), f) for f in sorted(pkg.rglob("*")) if f.suffix in (".py", ".json")]
    files += [("cuda/" + f.name, f) for f in sorted(kd.iterdir()) if f.suffix in (".cu", ".cuh")]
    h = hashlib.sha256()
    for name, f in files:
        h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def tree_line() -> str:
    """The console's first words of a run: which package it imported, and its sources' digest."""
    return f"cupymoe from {Path(__file__).resolve().parent} (sources {tree_digest()})"


def _source_digest(spec: ModuleSpec, options: Iterable[str], arch: str, version: tuple[int, int]) -> str:
    h = hashlib.sha256()
    kd = kernel_dir()
    h.update((kd / spec.file).read_bytes())
    for hdr in sorted(kd.glob("*.cuh")):  # every header any module could include
        h.update(hdr.name.encode())
        h.update(hdr.read_bytes())
    # include paths differ between machines but not the code they hold; key on the rest
    h.update(json.dumps([o for o in options if not o.startswith("-I")]).encode())
    h.update(arch.encode())
    h.update(repr(version).encode())
    h.update(json.dumps(spec.names).encode())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _cache_stem(module: str, arch: str, knobs: Optional[Knobs] = None) -> tuple[Path, str, tuple]:
    spec = MODULES[module]
    options = compile_options(arch, knobs)
    key = _source_digest(spec, options, arch, nvrtc_version())
    return cache_dir(knobs) / f"{module}-{arch}-{key[:20]}", key, options


def _read_cache(module: str, arch: str, stem: Path, key: str) -> Optional[CompiledModule]:
    if not (stem.with_suffix(".json").is_file() and stem.with_suffix(".cubin").is_file()):
        return None
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
        cubin = stem.with_suffix(".cubin").read_bytes()
        if meta.get("key") == key and len(cubin) == meta.get("cubin_len"):
            return CompiledModule(module, arch, cubin, meta["ptx"], meta["lowered"], meta["log"], True)
    except (OSError, ValueError, KeyError) as e:
        log.warning("ignoring unreadable kernel cache entry %s: %s", stem, e)
    return None


def is_cached(module: str, arch: str) -> bool:
    stem, key, _ = _cache_stem(module, arch)
    return _read_cache(module, arch, stem, key) is not None


def _nvrtc_compile(module: str, arch: str, options: tuple) -> CompiledModule:
    nvrtc = _nvrtc()
    spec = MODULES[module]
    source = (kernel_dir() / spec.file).read_text()
    prog = nvrtc.createProgram(source, spec.file, (), ())
    try:
        for name in spec.names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise KernelBuildError(f"NVRTC failed on cuda/{spec.file} for {arch}: {e}\n"
                                   f"{nvrtc.getProgramLog(prog)}") from None
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in spec.names}
        plog = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
        ptx = nvrtc.getPTX(prog)
        if isinstance(ptx, bytes):
            ptx = ptx.decode(errors="replace")
    finally:
        nvrtc.destroyProgram(prog)
    return CompiledModule(module, arch, cubin, ptx, lowered, plog)


def compile_module(module: str, arch: str, *, use_cache: bool = True) -> CompiledModule:
    """Compile one cuda/ module for `arch` (no GPU needed), through the disk cache."""
    if module not in MODULES:
        raise KernelBuildError(f"unknown kernel module {module!r}; known: {sorted(MODULES)}")
    stem, key, options = _cache_stem(module, arch)
    if use_cache:
        cm = _read_cache(module, arch, stem, key)
        if cm is not None:
            return cm
    cm = _nvrtc_compile(module, arch, options)
    if use_cache:
        try:
            meta = {"key": key, "cubin_len": len(cm.cubin), "ptx": cm.ptx, "lowered": cm.lowered, "log": cm.log}
            _atomic_write(stem.with_suffix(".cubin"), cm.cubin)
            _atomic_write(stem.with_suffix(".json"), json.dumps(meta).encode())
        except OSError as e:  # a read-only home must not stop the layer
            log.warning("could not write kernel cache %s: %s", stem, e)
    return cm


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for")
_RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def _parse_resources(plog: str, ptx: str, lowered: dict[str, str]) -> list[KernelResources]:
    by_mangled: dict[str, dict] = {}
    cur = None
    for line in plog.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            cur = by_mangled.setdefault(m.group(1), {"regs": 0, "st": 0, "ld": 0, "stack": 0, "smem": 0})
            continue
        if cur is None:
            continue
        m = _RE_FRAME.search(line)
        if m:
            cur["stack"], cur["st"], cur["ld"] = (int(g) for g in m.groups())
        m = _RE_USED.search(line)
        if m:
            cur["regs"] = int(m.group(1))
            s = _RE_SMEM.search(line)
            cur["smem"] = int(s.group(1)) if s else 0
    wgmma: dict[str, bool] = {}  # wgmma use, per entry, from the PTX bodies
    for m in re.finditer(r"\.entry\s+(\S+?)\s*\(", ptx):
        start = m.end()
        nxt = ptx.find(".entry", start)
        wgmma[m.group(1)] = "wgmma.mma_async" in ptx[start: nxt if nxt >= 0 else len(ptx)]
    out = []
    for name, mangled in lowered.items():
        r = by_mangled.get(mangled, {"regs": -1, "st": 0, "ld": 0, "stack": 0, "smem": 0})
        out.append(KernelResources(name, r["regs"], r["st"], r["ld"], r["stack"], r["smem"], wgmma.get(mangled, False)))
    return out


def modules_for(arch: str) -> list[str]:
    return [m for m, spec in MODULES.items() if spec.builds_for(arch)]


def compile_modules(modules: Iterable[str], arch: str, *, use_cache: bool = True, jobs: Optional[int] = None,
                    progress: Optional[Callable[[CompiledModule, float], None]] = None) -> list[CompiledModule]:
    """compile_module for several modules side by side (NVRTC releases the GIL: a thread a
    module), results in the order asked. `jobs`: threads at most (default CUPYMOE_BUILD_JOBS,
    else the CPUs); `progress(cm, seconds)` hears each module as it is done."""
    mods = list(modules)
    if jobs is None:
        jobs = Knobs.from_env().build_jobs or os.cpu_count() or 1

    def one(m: str) -> CompiledModule:
        t0 = time.perf_counter()
        cm = compile_module(m, arch, use_cache=use_cache)
        if progress:
            progress(cm, time.perf_counter() - t0)
        return cm

    if jobs <= 1 or len(mods) <= 1:
        return [one(m) for m in mods]
    with ThreadPoolExecutor(max_workers=min(jobs, len(mods)), thread_name_prefix="nvrtc") as pool:
        return list(pool.map(one, mods))


def format_report(modules: list[CompiledModule]) -> str:
    rows = [("module", "kernel", "regs", "spill st/ld", "stack", "static smem", "wgmma")]
    for cm in modules:
        for r in cm.resources():
            rows.append((cm.module, r.name, str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
                         str(r.stack_bytes), str(r.smem_bytes), "yes" if r.uses_wgmma else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def opt_in_smem(expr: str, max_smem: int) -> int:
    """The dynamic shared memory a kernel is opted in to once at load (0: none past 48 KB)."""
    m = re.fullmatch(r"grouped_gemm(?:_lora)?<\d+, (\d+), (\d+), (\d+), (\d+)>", expr)
    if m:
        return C.grouped_smem_bytes(*(int(g) for g in m.groups()))
    if expr.startswith("grouped_gemm_sm90_fp8_tma"):
        return C.sm90_fp8_tma_shape(expr).smem_bytes()
    if expr.startswith("grouped_gemm_sm90_fp8"):
        return C.sm90_fp8_smem_bytes()
    for v in TUNING.sm90_variants.values():
        for mode in GemmMode:
            for f in (WeightFormat.BF16,) + C.SM90_QUANT_FORMATS:
                if v.kernel(mode, f) == expr or (v.tma and f == WeightFormat.BF16 and mode != GemmMode.ROUTER
                                                 and v.kernel_lora(mode) == expr):
                    return v.smem_bytes(f)
    # sized per launch: sort_place's and the list builders' by the layer's experts, the wgmma
    # decode's by its K (less 1 KB: its static shared memory counts against the opt-in maximum)
    if expr == "sort_place" or expr.startswith(("decode_build_lists", "decode_topk_lists")):
        return max_smem
    if expr.startswith("topk_route_lora"):  # and its warps' t
        return min(max_smem, C.topk_route_lora_smem_bytes(C.MAX_ROUTER_WIDTH, C.LORA_ROUTER_T_MAX_RANK))
    if expr.startswith("topk_route"):  # its warps' scratch grows with the router's width
        return min(max_smem, C.topk_route_smem_bytes(C.MAX_ROUTER_WIDTH))
    m = re.fullmatch(r"decode_swapab_(?:gate_up|down|gate_up_lora)<(\d+)>", expr)
    if m:  # its ring, sized by the token tile
        return C.swapab_smem_bytes(int(m.group(1)))
    m = re.fullmatch(r"decode_swapab_fp8_(?:gate_up|down)<(\d+)>", expr)
    if m:  # the w8a8 ring, sized by the token tile
        return C.swapab_fp8_smem_bytes(int(m.group(1)))
    if expr.startswith("decode_wgmma_"):
        return max_smem - 1024
    m = re.fullmatch(r"lora_stack_t_seg(?:_experts)?<\d, (\d+)>", expr)
    if m:  # its cp.async ring
        return C.lora_seg_smem(int(m.group(1)))
    if expr.startswith(("lora_grouped_", "lora_stack_t_")):  # its warps' partial t grow with the rank (less its static buckets)
        return max_smem - 4096
    return 0


class KernelLibrary:
    """Every kernel of cuda/, compiled for one device and loaded, by name expression. Built
    once per device and process: nothing is compiled inside a forward or during capture."""

    def __init__(self, device_id: int, modules: Optional[Iterable[str]] = None,
                 progress: Optional[Callable[[str], None]] = None):
        import cupy

        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            dev = cupy.cuda.Device(device_id)
            cc = dev.compute_capability  # e.g. "90"
            self.arch = arch_for_capability(int(cc[:-1]), int(cc[-1]))
            self.max_smem = int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
            self.sm_count = int(dev.attributes["MultiProcessorCount"])
            self.name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"].decode()
            self._functions: dict[str, object] = {}
            self._modules = []
            names = modules_for(self.arch) if modules is None else list(modules)
            for cm in compile_modules(names, self.arch, progress=_progress_lines(self.arch, names, progress)):
                self._load(cupy, cm)

    def _load(self, cupy, cm: CompiledModule) -> None:
        mod = cupy.cuda.function.Module()
        mod.load(cm.cubin)
        self._modules.append(mod)  # the module lives as long as its functions
        drv = cupy.cuda.driver
        for expr, mangled in cm.lowered.items():
            fn = mod.get_function(mangled)
            smem = opt_in_smem(expr, self.max_smem)
            if smem:  # opt in to more than 48 KB of dynamic shared memory, once
                drv.funcSetAttribute(fn.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            self._functions[expr] = fn

    def __getitem__(self, name: str):
        try:
            return self._functions[name]
        except KeyError:
            raise KernelBuildError(f"kernel {name!r} is not in the library; known: {sorted(self._functions)}") from None

    def pointer(self, name: str) -> int:
        """The CUfunction handle of a kernel, as an int (what a launch takes)."""
        return int(self[name].ptr)


def _progress_lines(arch: str, names: list[str], progress: Optional[Callable[[str], None]]):
    """The compile's console words: one line before a first build (unless CUPYMOE_QUIET=1), then each
    module to `progress` when given."""
    missing = [m for m in names if not is_cached(m, arch)]
    if missing and not Knobs.from_env().quiet:
        print(f"cupymoe: compiling {len(missing)} of {len(names)} kernel modules for {arch} once "
              f"(cached in {cache_dir()}; ~2 min on 2 cores; `python -m cupymoe kernels` shows progress)",
              file=sys.stderr, flush=True)
    if progress is None:
        return None

    def heard(cm: CompiledModule, seconds: float) -> None:
        how = "from the cache" if cm.from_cache else f"compiled in {seconds:.1f} s"
        progress(f"kernels: {cm.module} for {arch} {how}")

    return heard


_LIBRARIES: dict[int, KernelLibrary] = {}


def library(device_id: int, progress: Optional[Callable[[str], None]] = None) -> KernelLibrary:
    """The process-wide KernelLibrary of a device (compiled once, shared by every layer)."""
    lib = _LIBRARIES.get(device_id)
    if lib is None:
        lib = _LIBRARIES[device_id] = KernelLibrary(device_id, progress=progress)
    return lib
