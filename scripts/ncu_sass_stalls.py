"""Summarise an Nsight Compute source page: per kernel, the warp stall reasons over all
SASS lines and the lines with the most stall samples.

Make the input on the device (the image has ncu):
    ncu --set full --import-source yes -k regex:decode_mma -c 2 -o f python3 -m cupymoe bench ...
    ncu -i f.ncu-rep --page source --csv --print-source sass > f.sass.csv
then here: python scripts/ncu_sass_stalls.py f.sass.csv [lines]

Each kernel with wgmmas (SASS HGMMA for bf16, QGMMA for fp8) is also split at its last wgmma line
(address order): what comes before (setup, main loop) and after (the epilogue; and the producer
warpgroup's code where the compiler placed it after, `--region` splits that off), as shares of the
stall samples and of the instructions executed: the epilogue's share decides whether a schedule
that hides it is worth building (DECISIONS, "Next for #40").
"""
import collections
import csv
import re
import sys


def kernels(path):
    """(kernel name, header, rows) for each kernel in the CSV, in file order."""
    name, header, rows = None, None, []
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "Kernel Name":
                if name:
                    yield name, header, rows
                name, header, rows = r[1], None, []
            elif r[0] == "Address":
                header = r
            elif header:
                rows.append(dict(zip(header, r)))
    if name:
        yield name, header, rows


WGMMA = re.compile(r"\b[HQI]GMMA\.")  # the wgmma's SASS: bf16 / fp16 HGMMA, e4m3 / e5m2 QGMMA, s8 IGMMA


def _count(r: dict, key: str) -> int:
    return int((r.get(key) or "0").replace(",", "") or 0)


def regions(rows: list) -> dict | None:
    """Shares of samples and executed instructions before and after the last HGMMA line (None
    without wgmmas)."""
    rows = sorted(rows, key=lambda r: int(r["Address"], 16))
    last = max((i for i, r in enumerate(rows) if WGMMA.search(r["Source"])), default=None)
    if last is None:
        return None
    out = {}
    for key, col in (("samples", "Warp Stall Sampling (All Samples)"), ("executed", "Instructions Executed")):
        before = sum(_count(r, col) for r in rows[:last + 1])
        after = sum(_count(r, col) for r in rows[last + 1:])
        out[key] = (before / ((before + after) or 1), after / ((before + after) or 1))
    return out


def address_blocks(rows: list, block: int = 0x4000, least: float = 0.005) -> list:
    """(offset from the kernel's first line, share of samples, instructions executed) of each `block`
    bytes of SASS holding at least `least` of the samples: where a kernel's regions lie (its main
    loop, epilogue and producer code are contiguous stretches)."""
    rows = sorted(rows, key=lambda r: int(r["Address"], 16))
    base = int(rows[0]["Address"], 16)
    samples, executed = collections.Counter(), collections.Counter()
    for r in rows:
        b = (int(r["Address"], 16) - base) // block * block
        samples[b] += _count(r, "Warp Stall Sampling (All Samples)")
        executed[b] += _count(r, "Instructions Executed")
    total = sum(samples.values()) or 1
    return [(b, samples[b] / total, executed[b]) for b in sorted(samples) if samples[b] >= least * total]


def main(path: str, lines: int = 15) -> None:
    seen = set()
    for name, header, rows in kernels(path):
        if name in seen:  # the same kernel profiled again
            continue
        seen.add(name)
        short = name.split("(const")[0]  # the name with its template arguments
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        total = collections.Counter()
        for r in rows:
            for h in reasons:
                total[h] += int(r[h] or 0)
        samples = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows) or 1
        print(f"== {short}: {len(rows)} SASS lines, {samples} samples")
        print("   " + ", ".join(f"{k[6:]} {v * 100 / samples:.0f}%" for k, v in total.most_common(8) if v))
        split = regions(rows)
        if split:
            print("   up to the last wgmma / after it (the epilogue, and code placed after it): samples "
                  f"{split['samples'][0] * 100:.1f}% / {split['samples'][1] * 100:.1f}%, executed "
                  f"{split['executed'][0] * 100:.1f}% / {split['executed'][1] * 100:.1f}%")
        print("   by 16 KB of SASS (offset: samples, executed): " + ", ".join(
            f"{b:#x}: {share * 100:.1f}% {ex}" for b, share, ex in address_blocks(rows)))
        top = sorted(rows, key=lambda r: -int(r["Warp Stall Sampling (All Samples)"] or 0))[:lines]
        for r in top:
            s = int(r["Warp Stall Sampling (All Samples)"] or 0)
            why = max(reasons, key=lambda h: int(r[h] or 0))
            print(f"   {s * 100 / samples:5.1f}% {why[6:]:12s} {r['Address'][-4:]} "
                  f"{r['Source'].strip()[:90]}  executed {r['Instructions Executed']}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 15)
