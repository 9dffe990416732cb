"""Is there an fp4 layout whose every bf16 pair is one shift and one mask? The decode kernels
place two e2m1 codes into a bf16x2 word by bit placement (quant.cuh fp4x8_to_bf16_pairs): in
each 16-bit half the sign goes to bit 15 and e1 e0 m to bits 8..6, so a pair's bits are
A = {6, 7, 8, 15, 22, 23, 24, 31}. A repacked layout in which every pair of a word (or of n / 32
words, read by funnel shifts) is one shift of the stored bits and one mask would need Z_n to be
the disjoint union of translates of A. This exact-cover search says whether it is, for each n
asked (NOTES.md v20, v34, v37). Runs on the CPU.

    python scripts/fp4_pair_tiling.py [--n 32 64 96 128]
"""

import argparse

PAIR = (6, 7, 8, 15, 22, 23, 24, 31)  # a bf16x2 pair's bits: sign 15, e1 e0 m at 8..6, each half
HALF = (6, 7, 8, 15)  # one half's


def tiling(n: int, mask: tuple) -> list | None:
    """Translates d of `mask` that partition Z_n (the first found), or None where none do."""
    used = [False] * n
    chosen: list = []

    def cover() -> bool:
        if all(used):
            return True
        p = used.index(False)
        for a in mask:  # the first free bit p is covered by the translate moving some a onto it
            d = (p - a) % n
            bits = [(b + d) % n for b in mask]
            if not any(used[b] for b in bits):
                for b in bits:
                    used[b] = True
                chosen.append(d)
                if cover():
                    return True
                chosen.pop()
                for b in bits:
                    used[b] = False
        return False

    return chosen if n % len(mask) == 0 and cover() else None


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[32, 64, 96, 128])
    args = ap.parse_args()
    for n in args.n:
        print(f"Z_{n}: pair mask {tiling(n, PAIR) or 'no tiling'}; half mask on Z_{n // 2}: "
              f"{tiling(n // 2, HALF) or 'no tiling'}")
