"""Whether two builds of the sm90 forward kernel run the same hot loop: the unmasked steady step's SASS, compared
exactly and with registers masked out (lab/log/v22.md: with the same instruction order, another register
allocation of that loop costs the D 128 kernel 1.3-3% of its cycles, as much as the levers A/Bs try to measure).

    python3 lab/tools/hot_loop_diff.py A B [--kernel REGEX]
    python3 lab/tools/hot_loop_diff.py A --fingerprint [--expect FILE]

A and B are libraries (libflashjax.so, or .so.xz as in .devcarry) or SASS dumps (cuobjdump -sass output, e.g. from
lab/tools/sass.sh). --fingerprint prints a short hash of A's hot loop (its instructions and registers, branch targets
aside): two builds with the same fingerprint run the same hot loop. With --expect, it also says whether the hash is
the one FILE records (lab/hot_loop_fingerprint.txt: main's, whose allocation is the best measured, v22-v25).
The kernel is the first whose mangled name matches REGEX (default: bf16 D 128, 128 x 128 tiles, uncapped, unpacked,
unsplit). The hot loop is the smallest loop (a backward branch) whose body issues HGMMAs and
a VOTE (the fast path's bound check, or the lazy rescale's) and applies no mask (a masked loop selects -INF once per
score; an unmasked one may a few times in its fallback softmax, as lab/experiments/v29-shared-reference.patch's
does once). Prints both loops'
lengths and how many instructions are identical in order (branch targets aside), identical but for registers, and
of the same opcode; "same hot loop" only when every instruction is identical.

Both modes also count the loop's same-parity reads: instructions (wgmmas aside) that read two general registers of
equal parity, neither from the operand reuse cache. v25 found the allocations with many of them slow (the row
references of the exponent FFMAs in registers of one parity: 43-45 in the loop, +2.8-3.4% cycles at full S 4k); main
has 8, and so do allocations 1.3-1.8% slower than main (lab/log/v29.md), so the count rejects that one class
without a device run and says nothing about the rest.
"""
import argparse
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile

from sass_waits import kernels, loops, opcode  # lab/tools/ is this script's directory

# The bf16 one: a full kernel-set build also has the fp16 kernel of the same shape, listed first by cuobjdump.
DEFAULT_KERNEL = r"bfloat16_tELi128ELi128ELi128E(Lb0E)+E"  # every compile-time flag false
ADDRESSES = re.compile(r"0x[0-9a-f]+")
REGISTERS = re.compile(r"\bU?R\d+\b|\bU?P\d\b")


def cuobjdump():
    try:
        import nvidia  # the wheels lab/tools/sass.sh installs into .venv
        path = os.path.join(list(nvidia.__path__)[0], "cu13", "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    path = shutil.which("cuobjdump")
    if path is None:
        sys.exit("hot_loop_diff: no cuobjdump (lab/tools/sass.sh installs it into .venv)")
    return path


def sass_text(path):
    if path.endswith(".sass") or path.endswith(".txt"):
        return open(path).read()
    with tempfile.TemporaryDirectory() as tmp:
        lib = path
        if path.endswith(".xz"):
            lib = os.path.join(tmp, "lib.so")
            with lzma.open(path) as src, open(lib, "wb") as dst:
                dst.write(src.read())
        return subprocess.run([cuobjdump(), "-sass", lib], check=True, capture_output=True, text=True).stdout


def kernel_instructions(text, pattern):
    for name, rows in kernels(text.splitlines()):
        if re.search(pattern, name) and rows:
            return rows
    sys.exit(f"hot_loop_diff: no kernel matching {pattern!r}")


MASK_SELECTS = 8  # fewer -INF selects than this: not a masked loop (a mask has one per score, 32+ per thread)


def hot_loop(rows):
    """The smallest loop whose body issues wgmmas and votes (the fast path's bound check, or the lazy rescale's) and
    applies no mask (a mask selects -INF for every score; an unmasked step's fallback softmax may a few times):
    the unmasked steady step, at every head dim."""
    best = None
    for first, last in loops(rows):
        body = [t for _, t in rows[first:last + 1]]
        if (any(t.startswith("HGMMA") for t in body) and any("VOTE." in t for t in body)
                and sum(t.startswith("FSEL") and "-INF" in t for t in body) < MASK_SELECTS
                and (best is None or len(body) < len(best))):
            best = body
    if best is None:
        sys.exit("hot_loop_diff: no unmasked loop with wgmmas and a vote in the kernel")
    return best


GENERAL_REGISTER = re.compile(r"(?<![U\w])R(\d+)(\.reuse)?")


def same_parity_reads(loop):
    """How many of the loop's instructions (wgmmas aside) read two general registers of equal parity, neither marked
    .reuse (the operand reuse cache serves those): the register-bank pattern of v25's slow allocations."""
    count = 0
    for text in loop:
        if opcode(text).startswith("HGMMA"):
            continue
        operands = text.split(None, 2 if text.startswith("@") else 1)[-1].split(",")[1:]  # sources, past the target
        parities = [int(m.group(1)) % 2 for operand in operands for m in GENERAL_REGISTER.finditer(operand)
                    if not m.group(2)]
        count += any(parities.count(p) >= 2 for p in (0, 1))
    return count


def fingerprint(loop):
    """12 hex digits that name a hot loop: its instructions in order, registers included, addresses masked."""
    return hashlib.sha1("\n".join(ADDRESSES.sub("_", t) for t in loop).encode()).hexdigest()[:12]


def expected_fingerprint(path):
    """The hash a fingerprint file records: its first line that is not blank or a # comment, first word."""
    for line in open(path):
        if line.strip() and not line.lstrip().startswith("#"):
            return line.split()[0]
    sys.exit(f"hot_loop_diff: no fingerprint in {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b", nargs="?")
    parser.add_argument("--kernel", default=DEFAULT_KERNEL)
    parser.add_argument("--fingerprint", action="store_true", help="print A's hot-loop fingerprint")
    parser.add_argument("--expect", help="with --fingerprint: a fingerprint file to compare with")
    args = parser.parse_args()
    hot_loop_of = lambda path: hot_loop(kernel_instructions(sass_text(path), args.kernel))
    if args.fingerprint:
        loop = hot_loop_of(args.a)
        found = fingerprint(loop)
        print(f"hot loop fingerprint {found} ({len(loop)} instructions, {same_parity_reads(loop)} same-parity reads)")
        if args.expect:
            expected = expected_fingerprint(args.expect)
            print("the recorded hot loop" if found == expected else
                  f"not the recorded hot loop ({expected}): an A/B against main also measures this allocation "
                  "(lab/log/v22.md)")
        return
    if args.b is None:
        parser.error("two builds to compare, or --fingerprint")
    loops = [hot_loop_of(p) for p in (args.a, args.b)]
    # Branch targets move whenever code elsewhere changes: addresses are masked in every comparison. Registers are
    # not, except in the second count: a loop that differs only in its registers is a different loop (v22).
    pairs = list(zip(*([ADDRESSES.sub("_", t) for t in loop] for loop in loops)))
    same_but_addresses = sum(x == y for x, y in pairs)
    same_but_registers = sum(REGISTERS.sub("_", x) == REGISTERS.sub("_", y) for x, y in pairs)
    same_opcode = sum(opcode(x) == opcode(y) for x, y in pairs)
    same = len(loops[0]) == len(loops[1]) and same_but_addresses == len(pairs)
    print(f"hot loop: {len(loops[0])} vs {len(loops[1])} instructions; in order, identical {same_but_addresses}, "
          f"identical but for registers {same_but_registers}, same opcode {same_opcode}; same-parity reads "
          f"{same_parity_reads(loops[0])} vs {same_parity_reads(loops[1])}")
    print("same hot loop" if same else "different hot loop: an A/B of these builds also measures its allocation")


if __name__ == "__main__":
    main()
