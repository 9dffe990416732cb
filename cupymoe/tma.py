"""TMA tensor maps for the Hopper grouped GEMM (cuda/grouped_sm90_tma.cu).

A tensor map is the 128-byte descriptor the TMA unit reads to copy a box of a 2-D tensor
into shared memory. Neither CuPy nor NVRTC makes one, so this module calls the driver's
`cuTensorMapEncodeTiled` through ctypes (libcuda is where every CUDA process already is).
The maps of a layer point at its weights and its workspace, whose addresses never change, so
they are encoded once at construction and kept in device memory in the order of
TMA_MAPS, which is the kernel's TMA_MAP_* numbering.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence

# the kernel's TMA_MAP_* indices, in order
TMA_MAPS = ("a_gate_up", "a_down", "shared_a_down", "gate", "up", "down", "shared_gate", "shared_up", "shared_down",
            "yw", "lora_t_gu", "lora_t_down", "lora_b_gate", "lora_b_up", "lora_b_down")
MAP_BYTES = 128
BOX_BYTES = 128  # bytes of K per box row: one 128-byte swizzle row (64 bf16, or 128 e4m3 codes)
BOX_K = BOX_BYTES // 2  # bf16 elements of K per box row

# CUtensorMap enums (cuda.h)
_DTYPE_UINT8 = 0  # e4m3 codes
_DTYPE_UINT16 = 1  # bf16 bits; the zero fill is 0 either way
_DTYPES = {1: _DTYPE_UINT8, 2: _DTYPE_UINT16}  # by element bytes
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION = {"none": 0, "64": 1, "128": 2, "256": 3}  # by knobs.L2Promotion value
_OOB_FILL_ZERO = 0


from .errors import TmaError  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class Matrix2D:
    """A row-major matrix in device memory: `rows` rows of `cols` elements of `elem` bytes (2:
    bf16, 1: e4m3 codes), rows `pitch` elements apart (default `cols`; more where a matrix reads
    the leading columns of a wider buffer, so the zero fill starts at its own K). `l2_promotion`:
    how far the L2 widens each box row's read from DRAM ("none", "64", "128", "256" bytes): the
    experts' weight maps take the plan's (CUPYMOE_WEIGHT_L2_PROMOTION), the rest 256."""

    ptr: int
    rows: int
    cols: int
    pitch: int = 0
    elem: int = 2
    l2_promotion: str = "256"

    @property
    def row_bytes(self) -> int:
        return self.elem * (self.pitch or self.cols)

    @property
    def box_k(self) -> int:
        """Elements of K a box row holds: one 128-byte swizzle row."""
        return BOX_BYTES // self.elem


_encode = None


def weight_matrix(lp, ptr, rows: int, cols: int, elem: int = 2) -> Matrix2D:
    """An expert weight matrix at the L2 promotion of the layer plan `lp` (CUPYMOE_WEIGHT_L2_PROMOTION)."""
    return Matrix2D(int(ptr), rows, cols, elem=elem, l2_promotion=lp.weight_l2_promotion.value)


def _driver_encode():
    global _encode
    if _encode is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise TmaError(f"libcuda.so.1 could not be loaded for cuTensorMapEncodeTiled: {e}") from e
        f = lib.cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                      ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _encode = f
    return _encode


def check_matrix(m: Matrix2D, box_rows: int, what: str) -> None:
    """What TMA needs of a matrix and a box: 16-byte aligned base and row pitch, extents
    below 2^32, boxes of at most 256 rows; a 128-byte swizzled box row (64 bf16, 128 codes)."""
    if m.elem not in _DTYPES:
        raise TmaError(f"{what}: elements of {m.elem} bytes; the maps hold 1 (e4m3) or 2 (bf16)")
    if m.ptr % 16:
        raise TmaError(f"{what}: base address {m.ptr:#x} is not 16-byte aligned")
    if m.row_bytes % 16 or m.row_bytes < m.elem * m.cols:
        raise TmaError(f"{what}: row pitch {m.row_bytes} bytes is not a multiple of 16 of at least "
                       f"{m.elem * m.cols}")
    if not (0 < m.rows < 2**32 and 0 < m.cols < 2**32):
        raise TmaError(f"{what}: extents {m.rows} x {m.cols} outside 1 .. 2^32 - 1")
    if not 0 < box_rows <= 256:
        raise TmaError(f"{what}: box of {box_rows} rows; TMA boxes hold 1 .. 256")


def encode(m: Matrix2D, box_rows: int, what: str = "matrix") -> bytes:
    """The tensor map of `m` read in boxes of `box_rows` rows x one 128-byte row of K (64 bf16
    or 128 codes), 128-byte swizzled (the layout wgmma_desc describes), zeros past the extents."""
    check_matrix(m, box_rows, what)
    out = (ctypes.c_uint8 * MAP_BYTES)()
    dims = (ctypes.c_uint64 * 2)(m.cols, m.rows)
    strides = (ctypes.c_uint64 * 1)(m.row_bytes)
    box = (ctypes.c_uint32 * 2)(m.box_k, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    rc = _driver_encode()(ctypes.addressof(out), _DTYPES[m.elem], 2, ctypes.c_void_p(m.ptr), dims, strides, box, elem,
                          _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION[m.l2_promotion], _OOB_FILL_ZERO)
    if rc != 0:
        raise TmaError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {what}: {m}, box {box_rows} x {m.box_k}")
    return bytes(out)


def encode_table(maps: Sequence[Optional[tuple[Matrix2D, int]]], names: Sequence[str] = TMA_MAPS) -> bytes:
    """The maps in `names` order ((matrix, box rows), or None for a map the layer never
    reads, left zero), back to back: 128-byte aligned in a 256-byte aligned buffer."""
    if len(maps) != len(names):
        raise ValueError(f"{len(maps)} maps given, the kernel reads {len(names)}: {tuple(names)}")
    return b"".join(bytes(MAP_BYTES) if spec is None else encode(spec[0], spec[1], name)
                    for name, spec in zip(names, maps))


# the swap-AB decode's maps (cuda/decode_swapab_sm90.cu SA_MAP_*, decode_swapab_fp8_sm90.cu
# SF_MAP_*), in order: each projection's weights in boxes of SWAPAB_BOX_ROWS rows (one m64 wgmma tile),
# then the LoRA slots' gate and up A in boxes of max_rank rows (decode_swapab_gate_up_lora)
SWAPAB_MAPS = ("gate", "up", "down", "shared_gate", "shared_up", "shared_down", "lora_gate_a", "lora_up_a")
SWAPAB_BOX_ROWS = 64


def swapab_table(lp, slot_ptrs: dict, lora=None) -> bytes:
    """The maps of the swap-AB decode (`lp` a plan.LayerPlan whose experts are bf16 or fp8-block
    as w8a8): the stacked routed weights ([n_local * rows, K]) and the shared expert's, 64-row
    boxes, bf16 bits or e4m3 codes by each one's format, in SWAPAB_MAPS order; a map the layer
    has no matrix for stays zero. Its tokens come by cp.async: no scratch map. `lora`
    (lora_slots.LoraSlots): the expert slots' gate and up A ([K S R, H], R-row boxes) where
    catalog.swapab_lora_rank allows their rank, else zeros."""
    cfg, n = lp.cfg, lp.n_local
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    Is = cfg.shared_expert_intermediate_size if cfg.has_shared_expert else 0
    box = SWAPAB_BOX_ROWS
    elem = {slot: 1 if f is not None and f.label == "fp8_block" else 2
            for slot, f in ((0, lp.routed_format), (n, lp.shared_format))}

    def one(p, slot, rows, cols, used):
        if not used:
            return bytes(MAP_BYTES)
        return encode(weight_matrix(lp, slot_ptrs[p][slot], rows, cols, elem[slot]), box, f"swapab {p} of slot {slot}")

    return b"".join([one("gate", 0, n * I, H, n), one("up", 0, n * I, H, n), one("down", 0, n * H, I, n),
                     one("gate", n, Is, H, Is), one("up", n, Is, H, Is), one("down", n, H, Is, Is),
                     *swapab_lora_maps(H, lora)])


def swapab_lora_maps(H: int, lora) -> list[bytes]:
    """The LoRA slots' gate and up A maps of the swap-AB table (zeros where the slots hold no expert
    deltas or their rank has no swap-AB form)."""
    from .catalog import swapab_lora_rank

    if lora is None or lora.experts is None or not swapab_lora_rank(lora.max_rank):
        return [bytes(MAP_BYTES)] * 2
    rows = lora.max_loras * lora.experts.table_slots * lora.max_rank
    return [encode(Matrix2D(lora.ptr(f"lora_{p}_a"), rows, H), lora.max_rank, f"swapab LoRA {p} A")
            for p in ("gate", "up")]


def layer_table(lp, slot_ptrs: dict, scratch, lora=None) -> bytes:
    """The maps of a layer's TMA GEMMs (`lp` a plan.LayerPlan): A of gate/up (xg) and of down (act,
    through the routed and the shared expert's K), the stacked routed weights and the shared
    expert's, and down's output (yw). `slot_ptrs[p]`: each table slot's weight address of
    projection p; `scratch`: the layer's ScratchView. The A maps span their buffers exactly. `lora`
    (lora_slots.LoraSlots with a stacked form): the LoRA stacked form's maps (cupymoe/lora_stack.py):
    T of gate/up and of down (A boxes) and each projection's Bext (its B tiles' boxes); else zeros."""
    from .catalog import TMA_A_BOX_ROWS, GemmMode

    cfg, n, i_max = lp.cfg, lp.n_local, lp.i_max
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    bn, bn_down = lp.sm90[GemmMode.GATE_UP].bn, lp.sm90[GemmMode.DOWN].bn
    gate_up, down = lp.sm90[GemmMode.GATE_UP].tma, lp.sm90[GemmMode.DOWN].tma
    Is = cfg.shared_expert_intermediate_size if cfg.has_shared_expert else 0
    xg_rows, act_rows = scratch.nbytes("xg") // (2 * H), scratch.nbytes("act") // (2 * i_max)
    bm = TMA_A_BOX_ROWS

    def routed(p, rows, cols, box, used):
        return (weight_matrix(lp, slot_ptrs[p][0], n * rows, cols), box) if n and used else None

    def shared(p, rows, cols, box, used):
        return (weight_matrix(lp, slot_ptrs[p][n], rows, cols), box) if Is and used else None

    return encode_table([
        (Matrix2D(scratch.ptr("xg"), xg_rows, H), bm) if lp.gathers_rows else None,
        (Matrix2D(scratch.ptr("act"), act_rows, I, i_max), bm) if down else None,
        (Matrix2D(scratch.ptr("act"), act_rows, Is, i_max), bm) if Is and down else None,
        routed("gate", I, H, bn // 2, gate_up), routed("up", I, H, bn // 2, gate_up),
        routed("down", H, I, bn_down, down),
        shared("gate", Is, H, bn // 2, gate_up), shared("up", Is, H, bn // 2, gate_up),
        shared("down", H, Is, bn_down, down),
        (Matrix2D(scratch.ptr("yw"), scratch.nbytes("yw") // (2 * H), H), bm) if down else None,  # down's stores
        *lora_maps(lp, scratch, lora),
    ])


def lora_maps(lp, scratch, lora) -> list:
    """The stacked form's five maps (TMA_MAPS' lora_*), None each where the layer has none."""
    from .catalog import TMA_A_BOX_ROWS, GemmMode

    ks = lora.stack_width if lora is not None else 0
    if not ks:
        return [None] * 5
    H, i_max, bm = lp.cfg.hidden_size, lp.i_max, TMA_A_BOX_ROWS
    bn, bn_down = lp.sm90[GemmMode.GATE_UP].bn, lp.sm90[GemmMode.DOWN].bn
    rows_gu, rows_down = scratch.nbytes("lora_t_gu") // (4 * ks), scratch.nbytes("lora_t_down") // (2 * ks)
    slots = lora.experts.table_slots
    return [(Matrix2D(scratch.ptr("lora_t_gu"), rows_gu, 2 * ks), bm),
            (Matrix2D(scratch.ptr("lora_t_down"), rows_down, ks), bm),
            (Matrix2D(lora.ptr("lora_gate_bx"), slots * i_max, ks), bn // 2),
            (Matrix2D(lora.ptr("lora_up_bx"), slots * i_max, ks), bn // 2),
            (Matrix2D(lora.ptr("lora_down_bx"), slots * H, ks), bn_down)]


# the w8a8 TMA GEMM's maps (cuda/grouped_sm90_fp8_tma.cu F8T_MAP_*), in order: e4m3 codes
# in boxes of FP8_BOX_ROWS rows x 128 codes (one warpgroup's A rows, a quarter of a B tile)
FP8_MAPS = ("a_down", "shared_a_down", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")
FP8_BOX_ROWS = 64


def fp8_table(lp, slot_ptrs: dict, scratch) -> bytes:
    """The maps of the w8a8 TMA GEMM (`lp` a plan.LayerPlan with fp8-block experts as w8a8):
    down's A (the activation's codes `qact` [P, I_max], through the routed experts' I and the
    shared expert's), the stacked routed e4m3 weights ([n_local * rows, K]) and the shared
    expert's. Gate/up's A is gathered by cp.async: no map. A matrix the layer lacks stays zero."""
    cfg, n, i_max = lp.cfg, lp.n_local, lp.i_max
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    Is = cfg.shared_expert_intermediate_size if cfg.has_shared_expert else 0
    fp8 = 1 if lp.routed_format.label == "fp8_block" else 0  # routed experts of another format: no maps
    sfp8 = 1 if Is and lp.shared_format is not None and lp.shared_format.label == "fp8_block" else 0
    act_rows = scratch.nbytes("qact") // i_max
    box = FP8_BOX_ROWS

    def w(p, slot, rows, cols, used):
        return (weight_matrix(lp, slot_ptrs[p][slot], rows, cols, elem=1), box) if used else None

    return encode_table([
        (Matrix2D(scratch.ptr("qact"), act_rows, I, i_max, elem=1), box) if n and fp8 else None,
        (Matrix2D(scratch.ptr("qact"), act_rows, Is, i_max, elem=1), box) if sfp8 else None,
        w("gate", 0, n * I, H, n and fp8), w("up", 0, n * I, H, n and fp8), w("down", 0, n * H, I, n and fp8),
        w("gate", n, Is, H, sfp8), w("up", n, Is, H, sfp8), w("down", n, H, Is, sfp8),
    ], FP8_MAPS)
