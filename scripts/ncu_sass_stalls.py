"""Summarise an Nsight Compute source page: per kernel, the warp stall reasons over all
SASS lines and the lines with the most stall samples.

Make the input on the device (the image has ncu):
    ncu --set full --import-source yes -k regex:decode_mma -c 2 -o f python3 -m cupymoe bench ...
    ncu -i f.ncu-rep --page source --csv --print-source sass > f.sass.csv
then here: python scripts/ncu_sass_stalls.py f.sass.csv [lines]

Each kernel with wgmmas is also split at its last HGMMA line (address order): what comes before
(setup, producer, main loop) and after (the epilogue), as shares of the stall samples and of the
instructions executed: the epilogue's share decides whether a ping-pong schedule (one warpgroup's
epilogue under the other's main loop) is worth building (DECISIONS, "Next for #40").
"""
import collections
import csv
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


def _count(r: dict, key: str) -> int:
    return int((r.get(key) or "0").replace(",", "") or 0)


def regions(rows: list) -> dict | None:
    """Shares of samples and executed instructions before and after the last HGMMA line (None
    without wgmmas)."""
    rows = sorted(rows, key=lambda r: int(r["Address"], 16))
    last = max((i for i, r in enumerate(rows) if "HGMMA" in r["Source"]), default=None)
    if last is None:
        return None
    out = {}
    for key, col in (("samples", "Warp Stall Sampling (All Samples)"), ("executed", "Instructions Executed")):
        before = sum(_count(r, col) for r in rows[:last + 1])
        after = sum(_count(r, col) for r in rows[last + 1:])
        out[key] = (before / ((before + after) or 1), after / ((before + after) or 1))
    return out


def main(path: str, lines: int = 15) -> None:
    seen = set()
    for name, header, rows in kernels(path):
        short = name.split("(")[0]
        if short in seen:  # the same kernel profiled again
            continue
        seen.add(short)
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
            print("   up to the last HGMMA / after it (the epilogue): samples "
                  f"{split['samples'][0] * 100:.1f}% / {split['samples'][1] * 100:.1f}%, executed "
                  f"{split['executed'][0] * 100:.1f}% / {split['executed'][1] * 100:.1f}%")
        top = sorted(rows, key=lambda r: -int(r["Warp Stall Sampling (All Samples)"] or 0))[:lines]
        for r in top:
            s = int(r["Warp Stall Sampling (All Samples)"] or 0)
            why = max(reasons, key=lambda h: int(r[h] or 0))
            print(f"   {s * 100 / samples:5.1f}% {why[6:]:12s} {r['Address'][-4:]} "
                  f"{r['Source'].strip()[:90]}  executed {r['Instructions Executed']}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 15)
