"""The experts-only entry: for servers that route themselves (vLLM's `fused_experts(hidden, w1, w2,
topk_weights, topk_ids)`), the layer's experts on the caller's expert ids and routing weights.

    layer.forward_experts(x_ptr, num_tokens, topk_ids_ptr, topk_weights_ptr, out_ptr, stream_ptr)
    out = layer.run_experts(x, topk_ids, topk_weights)     # torch tensors or CuPy arrays

The plan is the routed forward's with its router and routing kernel replaced by one small kernel,
experts_route_in (cuda/topk.cu), that copies the call's ids [N, k] int32 and weights [N, k] float32
into the scratch the routing kernels write; every later stage (norm, sort, gate/up, down, reduce)
is unchanged, on every path. What the call's routing means:

- the weights are used as given: no renormalisation (norm_topk_prob) and no routed_scaling_factor;
- ids are global expert ids in 0..router_width-1: E..router_width-1 are the layer's zero
  (identity) experts where it has them; other ranks' experts (expert parallelism) add nothing
  here; an id outside that range is flagged (MoeLayer.check_errors: ErrorBit.EXPERT_ID_RANGE) and
  its pair adds nothing: never an out-of-bounds access;
- a row may name an expert twice (each pair counts);
- the layer's pre-expert norm, if any, still applies to the experts' input;
- the shared expert (with its gate) is added as the layer has it unless `shared_expert=False`;
- with `lora_ids_ptr` ([N] int32 slots, -1 = base) the experts' adapter deltas are added on the
  layer's LoRA plans (MoeLayer(lora_experts=...)); an adapter's router delta is the caller's, as
  its routing is; an id past the slots is flagged (ErrorBit.LORA_ID_RANGE) and adds nothing.

Hash routing layers need no token ids here. CUPYMOE_PROFILE and NVTX ranges apply;
CUPYMOE_DUMP_DIR dumps `forward` only (its dumps recompute the router).
"""

from __future__ import annotations

import logging
from typing import Optional


from . import arrays, guard, profiling
from .errors import LoraError, MoeCallError
from .forward_plan import build_forward_plan, prefill_shape
from .launch import PackedPlan
from .layer_checks import check_path, note_device_pointers, optional_pointer
from .plan import CallValue, Path

log = logging.getLogger(__name__)


def shared_flag(layer, shared_expert: Optional[bool]) -> bool:
    """Whether an experts-only call adds the shared expert (None: as the layer has one)."""
    if shared_expert is None:
        return layer.cfg.has_shared_expert
    if not isinstance(shared_expert, bool):
        raise MoeCallError(f"shared_expert={shared_expert!r}: must be True, False or None (as the layer has it)")
    if shared_expert and not layer.cfg.has_shared_expert:
        raise MoeCallError("shared_expert=True: this layer has no shared expert")
    return shared_expert


def plan_for(layer, n: int, path: Optional[str], shared: bool, separated: bool = False,
             lora: bool = False) -> PackedPlan:
    """The packed experts-only plan of `n` rows (built on first use, then kept on the layer); `lora`:
    its LoRA variant, from the layer's LoRA LayerPlan (the experts' deltas; MoeLayer(lora_experts=...))."""
    lp = layer._lora_plan if lora else layer.plan
    p = Path(layer.select_path(n, path, lora=lora))
    key = (p, n if p != Path.PREFILL else prefill_shape(lp, layer.device, n), shared, separated, lora)
    cache = layer._experts_packed  # (reset when the layer binds a workspace)
    packed = cache.get(key)
    if packed is None:
        shape = layer.lora_shape("forward_experts(lora_ids_ptr=...)") if lora else None
        plan = build_forward_plan(lp, layer.device, n, p, separated=separated, given_routing=True,
                                  shared_expert=shared, lora=shape)
        packed = cache[key] = PackedPlan(plan, layer._resolve, layer.lib.pointer, layer._reduce())
    return packed


def check_call(layer, input_ptr, num_tokens, topk_ids_ptr, topk_weights_ptr, output_ptr,
               lora_ids_ptr=0) -> tuple[int, ...]:
    """Refuse a bad experts-only call before anything is launched: (N, x, ids, weights, out, lora ids)
    as ints, each pointer known to the runtime as memory the layer's GPU reads (check_device_pointers)."""
    from .layer_checks import check_device_pointers, check_disjoint, pointer, row_count

    n = row_count(num_tokens, layer.max_tokens)
    x = pointer("input_ptr", input_ptr, 16)  # the kernels read 16-byte vectors
    out = pointer("output_ptr", output_ptr, 16)
    ids = pointer("topk_ids_ptr", topk_ids_ptr, 4)
    w = pointer("topk_weights_ptr", topk_weights_ptr, 4)
    lora_ids = optional_pointer("lora_ids_ptr", lora_ids_ptr, 4)
    check_disjoint(x, out, n * layer.cfg.hidden_size * 2)
    check_device_pointers(layer, (("input_ptr", x), ("topk_ids_ptr", ids), ("topk_weights_ptr", w),
                                  ("output_ptr", out), ("lora_ids_ptr", lora_ids)))
    return n, x, ids, w, out, lora_ids


def forward_experts(layer, input_ptr, num_tokens, topk_ids_ptr, topk_weights_ptr, output_ptr, stream, *,
                    shared_expert: Optional[bool] = None, path: Optional[str] = None, lora_ids_ptr: int = 0) -> None:
    """MoeLayer.forward_experts (the module docstring says what the routing means)."""
    n, x, ids, w, out, lora_ids = check_call(layer, input_ptr, num_tokens, topk_ids_ptr, topk_weights_ptr, output_ptr,
                                             lora_ids_ptr)
    if lora_ids and layer.max_lora_rank and not layer.lora_experts:
        # the caller's routing leaves the router's delta out, so these slots would add nothing
        raise LoraError("forward_experts(lora_ids_ptr=...): this layer's slots take the router's adapters "
                        "alone (lora_experts=False), and the experts-only entry adds expert deltas only; "
                        "build it with lora_experts=True")
    shared = shared_flag(layer, shared_expert)
    stream = layer._stream(stream)
    check_path(path)  # before it keys the plan cache
    separated = layer._profile or profiling.recording_events()
    packed = plan_for(layer, n, path, shared, separated, lora=bool(lora_ids))
    packed.set_call_value(CallValue.TOPK_IDS, ids)
    packed.set_call_value(CallValue.TOPK_WEIGHTS, w)
    if lora_ids:
        packed.set_call_value(CallValue.LORA_IDS, lora_ids)
    ws = layer.workspace
    ws.use(stream)
    if layer._guard:  # guard mode: the red zones refilled before the launches, as forward does
        guard.arm_zones(layer.scratch.zones, stream)
    if layer._profile or profiling.observed():
        _observed(layer, packed, x, out, n, stream)
    else:
        packed.run(x, out, 0, n, stream)
    ws.done(stream)


def _observed(layer, packed: PackedPlan, x: int, out: int, n: int, stream: int) -> None:
    """The stages one by one inside NVTX ranges (and CUPYMOE_PROFILE's timed syncs)."""
    from .debug import cupy_stream

    s = cupy_stream(stream, layer.device_id)
    if layer._profile and s.is_capturing():
        raise MoeCallError("CUPYMOE_PROFILE synchronises the stream; unset it while capturing a graph")
    packed.prepare(x, out, 0, n, stream)
    timer = profiling.StageTimer(s, n, packed.plan.path.value, layer._profile)
    profiling.run_by_stage(timer, packed, n, stream)


def run_experts(layer, x, topk_ids, topk_weights, *, out=None, stream=None, shared_expert: Optional[bool] = None,
                path: Optional[str] = None, lora_ids=None):
    """MoeLayer.run_experts: arrays in (torch tensors or CuPy arrays), the output array back."""
    xa = arrays.view(x, "x")
    n = arrays.rows_of(xa, layer.cfg.hidden_size, layer.device_id)
    k = layer.cfg.num_experts_per_tok
    ids = arrays.checked_ptr(topk_ids, "topk_ids", device=layer.device_id, dtypes=("int32",), shape=(n, k))
    w = arrays.checked_ptr(topk_weights, "topk_weights", device=layer.device_id, dtypes=("float32",), shape=(n, k))
    lp = 0 if lora_ids is None else arrays.checked_ptr(lora_ids, "lora_ids", device=layer.device_id,
                                                        dtypes=("int32",), shape=(n,))
    if out is None:
        out = arrays.empty_like(x)
    op = arrays.checked_ptr(out, "out", device=layer.device_id, dtypes=arrays.BF16_BITS, shape=xa.shape)
    note_device_pointers(layer, int(xa.ptr), int(ids), int(w), int(lp), int(op))  # checked_ptr checked their device
    forward_experts(layer, xa.ptr, n, ids, w, op, arrays.current_stream(x) if stream is None else stream,
                    shared_expert=shared_expert, path=path, lora_ids_ptr=lp)
    return out
