"""Expert parallelism: which experts a rank owns, and the communicators the layer calls.

Routing stays global (every rank computes the same top-k); each rank runs only its own
experts and writes a partial output, rank 0 adding the shared expert and the zero-expert
identity terms, which belong to no rank; the partials are then summed by an all-reduce on
the caller's stream, so the shared expert is counted exactly once. With a communicator the
layer's output is the full layer's; without one it is this rank's partial.

A communicator is anything with `world_size`, `rank` and
`all_reduce(ptr, nbytes, dtype, stream)` (in-place sum of `nbytes` of `dtype` at device
pointer `ptr`, enqueued on the raw `cudaStream_t` `stream`). Two are provided:

- `NcclCommunicator`: NCCL through CuPy's bindings, built from a unique id that one process
  makes (`NcclCommunicator.new_unique_id()`) and shares with the others by any channel.
  NCCL calls on a capturing stream are captured into the CUDA graph. Destroy every CUDA
  graph that captured a communicator before the communicator itself (`close()`, or letting
  the last reference go): NCCL's destroy waits for those graphs to be released, so the other
  order hangs for good, holding Python's GIL (seen on the lent H200s with NCCL 2.28).
- `TorchCommunicator`: an adapter for a caller's torch.distributed process group (NCCL
  backend), through its own all-reduce on the same stream.
"""

from __future__ import annotations

import operator
from typing import Mapping, Optional, Protocol, Sequence

from .config import MoeConfig
from .errors import OptionError, ParallelError

DTYPES = ("bf16", "fp32")
_ELEM = {"bf16": 2, "fp32": 4}


class Communicator(Protocol):
    world_size: int
    rank: int

    def all_reduce(self, ptr: int, nbytes: int, dtype: str, stream: int) -> None: ...


def _rank(r) -> Optional[int]:
    """An owner entry as a rank: any integer (numpy, a 0-d integer tensor), not a bool or a float."""
    if isinstance(r, bool):
        return None
    try:
        return operator.index(r)
    except TypeError:
        return None


def owned_experts(cfg: MoeConfig, expert_owner: Optional[Sequence[int]] = None) -> list[int]:
    """The routed experts rank `cfg.ep_rank` computes: the contiguous block of
    E / ep_world_size by default, or those with `expert_owner[e] == ep_rank`."""
    if expert_owner is None:
        return list(cfg.owned_experts())
    if isinstance(expert_owner, (Mapping, str, bytes)) or not hasattr(expert_owner, "__iter__"):
        raise OptionError(f"expert_owner={expert_owner!r}: expected a sequence of ranks, one per expert "
                          "(a mapping's keys would be read as the ranks)")
    owner = list(expert_owner)
    if len(owner) != cfg.num_experts:
        raise OptionError(f"expert_owner has {len(owner)} entries; the layer has num_experts={cfg.num_experts}")
    ranks = [_rank(r) for r in owner]
    not_ranks = [(e, r) for e, (r, rank) in enumerate(zip(owner, ranks)) if rank is None]
    if not_ranks:
        raise OptionError(f"expert_owner holds entries that are not whole rank numbers: (expert, entry) {not_ranks[:5]}")
    owner = ranks
    bad = [(e, r) for e, r in enumerate(owner) if not 0 <= r < cfg.ep_world_size]
    if bad:
        raise OptionError(f"expert_owner maps experts to ranks outside 0..{cfg.ep_world_size - 1}: "
                         f"(expert, rank) {bad[:5]}")
    return [e for e, r in enumerate(owner) if r == cfg.ep_rank]


def check_communicator(cfg: MoeConfig, comm: Communicator) -> None:
    """A communicator must span exactly the config's EP world, at the config's rank."""
    if comm.world_size != cfg.ep_world_size or comm.rank != cfg.ep_rank:
        raise OptionError(f"communicator is rank {comm.rank} of {comm.world_size}, but the layer is "
                         f"ep_rank={cfg.ep_rank} of ep_world_size={cfg.ep_world_size}")


def _count(nbytes: int, dtype: str) -> int:
    if dtype not in DTYPES:
        raise OptionError(f"dtype={dtype!r}: all_reduce takes one of {DTYPES}")
    if nbytes % _ELEM[dtype]:
        raise OptionError(f"nbytes={nbytes} is not a whole number of {dtype} elements")
    return nbytes // _ELEM[dtype]


class NcclCommunicator:
    """One rank of an NCCL communicator on the current CUDA device."""

    # ncclDataType_t values (nccl.h); CuPy may not name bf16
    _NCCL_TYPES = {"fp32": 7, "bf16": 9}

    def __init__(self, world_size: int, rank: int, unique_id):
        if not 0 <= rank < world_size:  # before NCCL is loaded or joined
            raise OptionError(f"rank={rank} outside 0..{world_size - 1}")
        from cupy.cuda import nccl

        self.world_size, self.rank = int(world_size), int(rank)
        self._nccl = nccl
        self._comm = nccl.NcclCommunicator(self.world_size, unique_id, self.rank)

    @staticmethod
    def new_unique_id():
        """Made by one process, sent to every rank before they construct their communicator."""
        from cupy.cuda import nccl

        return nccl.get_unique_id()

    def close(self) -> None:
        """Destroy the NCCL communicator, on every rank; first release every CUDA graph
        that captured one of its all-reduces (see the module docstring)."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None

    def all_reduce(self, ptr: int, nbytes: int, dtype: str, stream: int) -> None:
        if self._comm is None:
            raise ParallelError("all_reduce on a closed NcclCommunicator")
        count = _count(nbytes, dtype)
        self._comm.allReduce(ptr, ptr, count, self._NCCL_TYPES[dtype], self._nccl.NCCL_SUM, stream)


class TorchCommunicator:
    """A torch.distributed process group's all-reduce, on the caller's stream."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce(self, ptr: int, nbytes: int, dtype: str, stream: int) -> None:
        import cupy
        import torch

        count = _count(nbytes, dtype)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None)
        arr = cupy.ndarray((count,), cupy.uint16 if dtype == "bf16" else cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
        t = torch.from_dlpack(arr)
        if dtype == "bf16":
            t = t.view(torch.bfloat16)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            self._dist.all_reduce(t, group=self.group)


# ----------------------------------------------------------------------------------
# one process per GPU
# ----------------------------------------------------------------------------------

def spawn_ranks(fn, world_size: int, *args, timeout: float = 900.0, make_unique_id=None,
                use_gpus: bool = True) -> list:
    """Run `fn(rank, world_size, unique_id, *args)` in one fresh process per GPU (rank r on
    device r) and return the ranks' results in rank order. `fn` must be importable (a
    module-level function); a rank's exception comes back as a ParallelError (a RuntimeError) with its
    traceback, and a rank that dies without one (a native crash) fails the call at once
    instead of leaving the others waiting. `make_unique_id` defaults to NCCL's; the
    launcher example scripts/ep_launch.py is built on this."""
    import multiprocessing as mp
    import queue
    import time

    ctx = mp.get_context("spawn")  # CUDA does not survive fork
    uid = (make_unique_id or NcclCommunicator.new_unique_id)()
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, uid, args, results, use_gpus, timeout),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) + len(failures) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                # a rank that died without a word (a crash in native code) would otherwise
                # leave the others waiting in their collectives until the deadline
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead or time.monotonic() > deadline:
                    why = (f"rank(s) {dead} exited with code(s) {[procs[r].exitcode for r in dead]} and no result"
                           if dead else f"no result from ranks {sorted(set(range(world_size)) - set(got))} "
                                        f"in {timeout:.0f} s")
                    failures.append(why)
                    break
                continue
            if ok:
                got[rank] = payload
            else:
                failures.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            if failures:  # the survivors would wait for the failed rank forever
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        raise ParallelError("expert-parallel ranks failed:\n" + "\n".join(failures))
    return [got[r] for r in range(world_size)]


def _rank_main(fn, rank, world_size, uid, args, results, use_gpus=True, timeout=None) -> None:
    import faulthandler
    import traceback

    if timeout:  # a rank stuck in a collective says where, on stderr, before the launcher gives up
        faulthandler.dump_traceback_later(max(1.0, timeout - 5.0), exit=False)
    try:
        if use_gpus:
            import cupy

            cupy.cuda.Device(rank).use()
        results.put((rank, True, fn(rank, world_size, uid, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
