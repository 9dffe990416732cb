"""Does NCCL work between this machine's GPUs?  One process per GPU, one all-reduce each.

    NCCL_DEBUG=INFO python scripts/nccl_smoke.py --gpus 2 [--backend cupy|torch]

Run it before the expert-parallel tests when they hang: it separates "NCCL cannot start
here" from "the layer's use of it is wrong". Each rank all-reduces a float32 vector holding
its rank + 1, eagerly and inside a CUDA graph, and checks the sum.
"""

from __future__ import annotations

import argparse
import sys
import time


def rank_main(rank: int, world: int, uid, count: int, backend: str) -> dict:
    import cupy

    from cupymoe.parallel import NcclCommunicator, TorchCommunicator

    def step(what):  # where a hang happens, on stderr
        print(f"rank {rank}: {what} at {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    if backend == "torch":  # uid is a free TCP port on this host for torch's rendezvous
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{uid}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        comm = TorchCommunicator()
    else:
        comm = NcclCommunicator(world, rank, uid)
    t_init = time.perf_counter() - t0
    step("communicator made")
    s = cupy.cuda.Stream(non_blocking=True)
    want = world * (world + 1) / 2
    x = cupy.full(count, rank + 1, cupy.float32)
    comm.all_reduce(int(x.data.ptr), x.nbytes, "fp32", s.ptr)
    s.synchronize()
    eager_ok = bool((x == want).all())
    step(f"eager all-reduce done, ok={eager_ok}")
    x.fill(rank + 1)
    s.begin_capture()
    comm.all_reduce(int(x.data.ptr), x.nbytes, "fp32", s.ptr)
    g = s.end_capture()
    g.launch(s)
    s.synchronize()
    graph_ok = bool((x == want).all())
    step(f"captured all-reduce replayed, ok={graph_ok}")
    del g  # a graph that captured NCCL calls goes before the communicator (cupymoe.parallel)
    if backend == "cupy":
        comm.close()
    return dict(init_s=round(t_init, 2), eager_ok=eager_ok, graph_ok=graph_ok)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--count", type=int, default=1 << 20)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--backend", choices=("cupy", "torch"), default="cupy",
                    help="cupy: cupymoe.parallel.NcclCommunicator; torch: TorchCommunicator over torch.distributed")
    args = ap.parse_args()

    import cupy

    from cupymoe.parallel import spawn_ranks

    have = cupy.cuda.runtime.getDeviceCount()
    if have < args.gpus:
        print(f"nccl_smoke: needs {args.gpus} GPUs, this machine has {have}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res = spawn_ranks(rank_main, args.gpus, args.count, args.backend, timeout=args.timeout,
                      make_unique_id=_free_port if args.backend == "torch" else None)
    print(f"nccl_smoke ({args.backend}): {args.gpus} ranks in {time.perf_counter() - t0:.1f} s: {res}")
    return 0 if all(r["eager_ok"] and r["graph_ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
