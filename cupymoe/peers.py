"""The implementations a user would pick instead of cupymoe, timed in the same bench run.

- `eager`: the transformers-style per-expert loop (torch, no graph: it syncs to find each
  expert's rows): for every expert some row chose, gather its rows, run the MLP, add the
  weighted result.
- `grouped_mm`: torch's grouped-GEMM pipeline: argsort the (row, slot) pairs by expert,
  gather, `torch._grouped_mm` for gate, up and down, silu(gate) * up, weighted index_add.
  No host sync, so it is captured in a CUDA graph like cupymoe.

Both route with torch softmax -> top-k -> renormalise, as PERFORMANCE.md's peers did, and
read the very same device weights as the cupymoe layer (zero-copy views of its arrays).
`same_function(cfg)` says when that is also cupymoe's math (softmax routing, renormalised,
silu experts without biases, no shared expert): then the bench checks that the outputs agree.
"""

from __future__ import annotations

from typing import Callable

from .errors import OptionError


def same_function(cfg) -> bool:
    return (cfg.scoring_func == "softmax" and cfg.norm_topk_prob and not cfg.topk_then_softmax
            and not cfg.has_correction_bias and cfg.n_group == 1 and not cfg.zero_expert_num
            and cfg.hidden_act == "silu" and not cfg.has_expert_bias and not cfg.has_router_bias
            and not cfg.has_shared_expert and not cfg.pre_expert_norm and cfg.routed_scaling_factor == 1.0)


def _bf16(torch, cupy_bits):
    """A torch bf16 view of a CuPy uint16 array (bf16 bits), no copy."""
    return torch.from_dlpack(cupy_bits).view(torch.bfloat16)


class TorchPeers:
    """The two peers over one cupymoe layer's weights (routed experts only)."""

    def __init__(self, layer):
        import torch

        self.torch = torch
        cfg = layer.cfg
        if cfg.ep_world_size != 1:
            raise OptionError("the torch peers run the whole layer on one GPU (ep_world_size must be 1)")
        self.k, self.E = cfg.num_experts_per_tok, cfg.num_experts
        W = layer.weights
        fmt = getattr(W, "format", "bf16")
        if fmt != "bf16":  # the stacked arrays would be codes, not bf16 bits
            raise OptionError(f"the torch peers read bf16 routed experts; this layer's are {fmt}")
        self.router = _bf16(torch, W.router)[: cfg.num_experts]  # [E, H]
        self.gate = _bf16(torch, W.experts["gate"])  # [E, I, H]
        self.up = _bf16(torch, W.experts["up"])
        self.down = _bf16(torch, W.experts["down"])  # [E, H, I]

    def _route(self, x):
        torch = self.torch
        probs = torch.softmax((x @ self.router.t()).float(), dim=-1)
        w, ids = torch.topk(probs, self.k, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), ids

    def grouped_mm(self, x, out) -> None:
        """out[N, H] (bf16) = the routed experts of x, through torch._grouped_mm."""
        torch = self.torch
        w, ids = self._route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        rows = order // self.k
        # counts by scatter_add: bincount would read the max id back to the host (no capture)
        counts = torch.zeros(self.E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x[rows]
        g = torch._grouped_mm(xs, self.gate.transpose(1, 2), offs=offs)
        u = torch._grouped_mm(xs, self.up.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(torch.nn.functional.silu(g) * u, self.down.transpose(1, 2), offs=offs)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        acc.index_add_(0, rows, y.float() * w.flatten()[order, None])
        out.copy_(acc)

    def eager(self, x, out) -> None:
        """The per-expert loop of transformers' MoE blocks (host syncs: not capturable)."""
        torch = self.torch
        w, ids = self._route(x)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        for e in torch.unique(ids).tolist():
            rows, slots = torch.nonzero(ids == e, as_tuple=True)
            xe = x[rows]
            h = torch.nn.functional.silu(xe @ self.gate[e].t()) * (xe @ self.up[e].t())
            acc.index_add_(0, rows, (h @ self.down[e].t()).float() * w[rows, slots, None])
        out.copy_(acc)

    def impls(self) -> dict[str, Callable]:
        return {"grouped_mm": self.grouped_mm, "eager": self.eager}
