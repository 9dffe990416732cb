"""Expert parallelism, one process per GPU: a launcher example and a timing run.

    python scripts/ep_launch.py --preset qwen3-235b-a22b --gpus 2 --tokens 1 64 4096

Each rank builds the same random layer (same seed), keeps its E / world experts, and
joins an NCCL communicator made from a unique id that the launcher (cupymoe.parallel.
spawn_ranks) hands to every rank. Every rank times CUDA-graph replays of its forward
(experts + all-reduce); rank 0 then times the whole layer on its one GPU for comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def rank_main(rank: int, world: int, uid, preset: str, tokens, seed: int, replays: int) -> dict:
    import cupy
    import numpy as np

    from cupymoe import MoeLayer
    from cupymoe.bench import preset_config, random_device_weights
    from cupymoe.parallel import NcclCommunicator
    from cupymoe.verify import bf16_bits

    cfg = preset_config(preset)
    hw = random_device_weights(cfg, seed)  # the same weights on every rank
    comm = NcclCommunicator(world, rank, uid)
    layers = {"ep": MoeLayer(cfg.replace(ep_world_size=world, ep_rank=rank), hw, max_tokens=max(tokens), comm=comm)}
    if rank == 0:
        layers["single"] = MoeLayer(cfg, hw, max_tokens=max(tokens))
    del hw
    s = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(seed)
    times: dict = {}
    for n in tokens:
        x = cupy.asarray(bf16_bits(rng.standard_normal((n, cfg.hidden_size), dtype=np.float32)))
        out = cupy.empty_like(x)
        for name in ("ep", "single"):
            if name not in layers:
                continue
            layer = layers[name]
            layer.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr)  # warm
            s.begin_capture()
            layer.forward(int(x.data.ptr), n, int(out.data.ptr), s.ptr)
            g = s.end_capture()
            g.launch(s)
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            reps = []
            for _ in range(5):
                e0.record(s)
                for _ in range(replays):
                    g.launch(s)
                e1.record(s)
                e1.synchronize()
                reps.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / replays)
            times[(name, n)] = statistics.median(reps)
            del g  # graphs that captured NCCL calls go before the communicator (cupymoe.parallel)
    comm.close()
    return {f"{k[0]}:{k[1]}": v for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-235b-a22b")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy

    from cupymoe.parallel import spawn_ranks

    have = cupy.cuda.runtime.getDeviceCount()
    if have < args.gpus:
        print(f"ep_launch: needs {args.gpus} GPUs, this machine has {have}", file=sys.stderr)
        return 2
    res = spawn_ranks(rank_main, args.gpus, args.preset, tuple(args.tokens), args.seed, args.replays)
    print(f"{args.preset}: expert parallel over {args.gpus} GPUs (NCCL all-reduce included) vs one GPU")
    rows = []
    for n in args.tokens:
        ep = max(r[f"ep:{n}"] for r in res)  # the step ends when the slowest rank ends
        single = res[0][f"single:{n}"]
        rows.append(dict(N=n, ep_us=round(ep, 1), single_us=round(single, 1), speedup=round(single / ep, 2)))
        print(f"  N={n:<6} EP x{args.gpus}: {ep:9.1f} us   one GPU: {single:9.1f} us   speed-up {single / ep:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, gpus=args.gpus, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
