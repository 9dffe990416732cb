"""A few forwards of a small layer on each path, for Nsight's NVTX filters:

    ncu --nvtx --nvtx-include "cupymoe@moe/gate_up/" --clock-control none python scripts/nvtx_probe.py

profiles the gate/up kernels alone (the `moe` range of a forward, its `gate_up` stage).
"""

import numpy as np

from cupymoe import MoeLayer, testing
from cupymoe.verify import run_layer

cfg = testing.tiny_config("qwen3_moe")
rng = np.random.default_rng(0)
hw = testing.random_host_weights(cfg, rng)
layer = MoeLayer(cfg, hw, max_tokens=64, decode_max_tokens=8)
for n, path in ((1, "decode"), (64, "prefill")):
    run_layer(layer, rng.standard_normal((n, cfg.hidden_size)).astype(np.float32), path)
print("nvtx_probe: done")
