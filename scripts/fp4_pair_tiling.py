"""Is there an fp4 layout whose every bf16 pair is one shift and one mask? The decode kernels
place two e2m1 codes into a bf16x2 word by bit placement (quant.cuh fp4x8_to_bf16_pairs): in
each 16-bit half the sign goes to bit 15 and e1 e0 m to bits 8..6, so a pair's bits are
A = {6, 7, 8, 15, 22, 23, 24, 31}. A repacked layout in which every pair of a word (or of n / 32
words, read by funnel shifts) is one shift of the stored bits and one mask would need Z_n to be
the disjoint union of translates of A. This exact-cover search says whether it is, for each n
asked (none is: benchmarks/DECISIONS.md, fp4). Runs on the CPU.

With --schemes it searches what the kernels use instead: three pairs of a 32-bit
word at rotations of A (one rotate and one mask each, none for rotation 0) and the fourth pair in
the 8 bits left over, placed by a mask, one multiply by a constant of at most three set bits
(its low or its high 32 bits) and a mask. It prints every such scheme: the bits of the fourth
pair's code (m, e0, e1, sign, low half; + 16 high) and the constant, and checks that
cupymoe.formats.fp4_word_bit_map is one of them.

    python scripts/fp4_pair_tiling.py [--n 32 64 96 128] [--schemes]
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


def fourth_pair_constants(bits: tuple, max_set_bits: int = 3) -> list:
    """Constants K (at most `max_set_bits` set bits below 2^48) and which half of x * K ("lo":
    bits 0-31, "hi": 32-63) place the fourth pair whose code bits (m, e0, e1, sign) sit at `bits`
    (low half; + 16 in the high half): (x * K) & A puts every one of the 256 codes of the two
    halves where A wants them, x being the word masked to those 8 bits."""
    from itertools import combinations

    want_at = HALF  # m, e0, e1, sign -> bf16 bits 6, 7, 8, 15
    found = []
    mask = sum(1 << b for b in PAIR)
    for k in range(1, max_set_bits + 1):
        for ks in combinations(range(48), k):
            K = sum(1 << b for b in ks)
            for half in ("lo", "hi"):
                ok = True
                for codes in range(256):
                    x = want = 0
                    for i in range(4):
                        lo, hi = (codes >> i) & 1, (codes >> (4 + i)) & 1
                        x |= lo << bits[i] | hi << (bits[i] + 16)
                        want |= lo << want_at[i] | hi << (want_at[i] + 16)
                    prod = x * K
                    got = (prod if half == "lo" else prod >> 32) & 0xFFFFFFFF & mask
                    if got != want:
                        ok = False
                        break
                if ok:
                    found.append((half, K))
    return found


def schemes() -> list:
    """(rotations of pairs 0-2, the fourth pair's bits (m, e0, e1, sign), constants) for every
    three disjoint rotations of A whose leftover 8 bits a mask-multiply-mask places."""
    from itertools import combinations, permutations

    out = []
    for rots in combinations(range(16), 3):  # A repeats every 16 bits: rotations mod 16 suffice
        used = set()
        for r in rots:
            used |= {(b + r) % 32 for b in PAIR}
        if len(used) != 24:
            continue
        left = sorted(b for b in range(16) if b not in used)
        for bits in permutations(left):
            consts = fourth_pair_constants(bits)
            if consts:
                out.append((rots, bits, consts))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[32, 64, 96, 128])
    ap.add_argument("--schemes", action="store_true", help="the three-rotations-and-a-multiply layouts (the kernels' kind)")
    args = ap.parse_args()
    for n in args.n:
        print(f"Z_{n}: pair mask {tiling(n, PAIR) or 'no tiling'}; half mask on Z_{n // 2}: "
              f"{tiling(n // 2, HALF) or 'no tiling'}")
    if args.schemes:
        found = schemes()
        for rots, bits, consts in found:
            print(f"rotations {rots}: fourth pair m, e0, e1, sign at {bits}; "
                  + ", ".join(f"{h} {k:#x}" for h, k in consts[:3]) + (" ..." if len(consts) > 3 else ""))
        from cupymoe import formats

        dest = formats.fp4_word_bit_map()
        used = ((0, 3, 6), tuple(int(dest[4 * 3 + b]) for b in range(4)))
        print(f"{len(found)} schemes; the kernels' (rotations 0, 3, 6; fourth pair at {used[1]}, lo 0x4108): "
              f"{'among them' if any((r, b) == used and ('lo', 0x4108) in c for r, b, c in found) else 'NOT FOUND'}")
