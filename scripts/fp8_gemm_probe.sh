#!/usr/bin/env bash
# Where the w8a8 TMA gate/up's time goes (issue 40): the same bench --stages on three trees, the
# two-warpgroup TMA form forced, qwen3-30b-a3b fp8 at 4096 and 16384 rows:
#   full      this tree;
#   no_epi    gate/up's epilogue replaced by a never-taken store of the accumulators' sum (the main
#             loop kept, nothing written: down reads stale codes, which does not change its time);
#   no_promo  no_epi, and the main loop's fp32 promotion left out too (the wgmmas and stage waits kept).
# The probe trees compute wrong outputs: timing only. Logs and JSON as $OUT/probe.tgz.
#
#   OUT=/tmp/out bash scripts/fp8_gemm_probe.sh     (~3 minutes on a warm H200)
set -u
DEST=${OUT:?set OUT to a folder for the logs}
W=$(mktemp -d)
save() { tar czf "$DEST/probe.tgz" -C "$W" .; }
for t in ${PROBES:-no_epi no_promo}; do
  mkdir -p "$W/$t" && cp -r cupymoe cuda "$W/$t/"
  python3 - "$W/$t/cuda/grouped_sm90_fp8_tma.cu" "$t" <<'PY'
import sys
path, which = sys.argv[1], sys.argv[2]
s = open(path).read()
start = s.index("    if (MODE == MODE_GATE_UP) {\n        with_activation(")
end = s.index("    } else {  // each half's weighted bf16 outputs")
s = s[:start] + """    if (MODE == MODE_GATE_UP) {  // probe: no epilogue, the accumulators kept alive
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 64; ++i) sum += acc[0][i] + acc[1][i];
        if (sum == 1234.5678f) q_out[threadIdx.x] = 1;
""" + s[end:]
if which == "no_promo":
    for call in ("fp8_promote<true>(acc[half], blk, a, s0, s1);", "fp8_promote<false>(acc[half], blk, a, half ? s1 : s0, 0.0f);"):
        assert call in s
        s = s.replace(call, "acc[half][0] += blk[0];  // probe: no promotion")
open(path, "w").write(s)
PY
done
for t in . $(for p in ${PROBES:-no_epi no_promo}; do echo "$W/$p"; done); do
  PYTHONPATH=$t timeout 150 python3 -P -m cupymoe kernels > "$W/kernels-$(basename "$t").log" 2>&1 || echo "kernels $t failed"
done
for round in ${ROUNDS:-1 2}; do
  for t in . $(for p in ${PROBES:-no_epi no_promo}; do echo "$W/$p"; done); do
    name=$([ "$t" = . ] && echo full || basename "$t")
    CUPYMOE_SM90_FP8_VARIANT=tma PYTHONPATH=$t timeout 60 python3 -P -m cupymoe bench --preset qwen3-30b-a3b --format fp8_block \
      --tokens 4096 16384 --no-peers --repeats 5 --replays 10 --stages --json "$W/$name-$round.json" > "$W/$name-$round.log" 2>&1
    echo "$name round $round:"; grep -E "N=|gate_up|down" "$W/$name-$round.log" | cut -c1-110
    save
  done
done
