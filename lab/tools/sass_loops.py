"""The loops of each kernel in a SASS dump, and what they spend on warp-uniformity: per loop (a backward branch whose
body issues HGMMAs) its instruction count, R2UR moves (values ptxas could not keep in uniform registers: every wgmma
descriptor built from them needs its own moves) and BSSY reconvergence points.

    python3 lab/tools/sass_loops.py DUMP.sass [--kernel REGEX] [--hgmma N]

DUMP is `cuobjdump -sass` output (lab/tools/sass.sh makes one; a cubin of a few kernels compiles in minutes here:
an explicit instantiation of e.g. detail::launch_varlen_kernels<bfloat16_t, 128, false> from fwd_launch.cuh, built
with tools/check_compile.sh's flags and -cubin). --hgmma keeps the loops with exactly N HGMMAs (16: one D 128
step's QK^T and PV at 128 x 128)."""
import argparse
import re


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump")
    parser.add_argument("--kernel", default=".", help="regex over the mangled kernel names")
    parser.add_argument("--hgmma", type=int, default=16)
    args = parser.parse_args()
    for function in re.split(r"\n\s+Function : ", open(args.dump).read())[1:]:
        name = function.split("\n", 1)[0].strip()
        if not re.search(args.kernel, name):
            continue
        code = [(int(a, 16), t) for a, t in re.findall(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", function)]
        at = {a: i for i, (a, _) in enumerate(code)}
        loops = []
        for i, (address, text) in enumerate(code):
            branch = re.search(r"BRA(?:\.\S+)?\s+0x([0-9a-f]+)", text)
            target = int(branch.group(1), 16) if branch else None
            if target is None or target >= address or target not in at:
                continue
            body = [t for _, t in code[at[target]:i + 1]]
            if sum("HGMMA" in t for t in body) == args.hgmma:
                loops.append(f"{len(body)} instr, R2UR {sum(t.startswith('R2UR') for t in body)}, "
                             f"BSSY {sum('BSSY' in t for t in body)}")
        print(f"{name[:120]}\n  {len(code)} instructions; loops: {loops}")


if __name__ == "__main__":
    main()
