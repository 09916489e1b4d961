"""Compressed view of each sm90 forward steady step in a cuobjdump SASS listing (see lab/tools/sass.sh).

    python lab/tools/sass_waits.py FILE.sass [--width N]

For every kernel and every S wait (WARPGROUP.DEPBAR.LE gsb0, 0x1), prints the instructions that follow in address
order up to the next BAR.SYNC (the next ping-pong turn) as runs of opcodes ("MUFUx3"), with WAIT0x0 for the PV
wait and BRA[predicate->target] for branches.
"""
import argparse
import re


def kernels(lines):
    """(mangled name, [(address, instruction text)]) for each kernel of a cuobjdump -sass listing, given its lines."""
    name, insts = None, []
    for line in lines:
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                yield name, insts
            name, insts = m.group(1), []
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and name:
            insts.append((int(m.group(1), 16), m.group(2).strip()))
    if name:
        yield name, insts


BRANCH_TARGET = re.compile(r"\bBRA(?:\.\S+)?\s+(?:`?\(?)?(0x[0-9a-f]+)")


def branch_target(text):
    """The address a branch instruction's text jumps to, or None for any other instruction."""
    m = BRANCH_TARGET.search(text)
    return int(m.group(1), 16) if m else None


def loops(rows):
    """(first, last) indices into rows, [(address, instruction text)] in address order, of every loop: a backward
    branch at rows[last] to the address of rows[first]."""
    index = {address: i for i, (address, _) in enumerate(rows)}
    for last, (address, text) in enumerate(rows):
        target = branch_target(text)
        if target is not None and target < address and target in index:
            yield index[target], last


def opcode(text):
    """The opcode of an instruction's text, past its predicate (e.g. "@!P0")."""
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def token(addr, text):
    words = text.split()
    op = opcode(text)
    if op.startswith("WARPGROUP.DEPBAR"):
        return "WAIT" + words[-1]
    if op == "BRA":
        predicate = words[0] if words[0].startswith("@") else ""
        return f"BRA[{predicate}->{words[-1][-5:]}]"
    if op.startswith("BAR."):
        return op
    return op.split(".")[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("sass")
    parser.add_argument("--width", type=int, default=1200, help="characters per step shown")
    args = parser.parse_args()
    with open(args.sass) as listing:
        listed = list(kernels(listing))
    for name, insts in listed:
        print(f"== {name}")
        for i, (addr, text) in enumerate(insts):
            if "DEPBAR.LE gsb0, 0x1" not in text:
                continue
            runs = []
            for a, t in insts[i:]:
                tok = token(a, t)
                if runs and runs[-1][0] == tok:
                    runs[-1][1] += 1
                else:
                    runs.append([tok, 1])
                if tok.startswith("BAR.SYNC"):
                    break
            line = " ".join(tok + (f"x{n}" if n > 1 else "") for tok, n in runs)
            print(f"  from {addr:x}: {line[:args.width]}")


if __name__ == "__main__":
    main()
