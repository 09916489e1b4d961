#!/usr/bin/env python3
"""Where the sm90 forward kernel's warps spend their time, by stage: ncu's warp-state samples of one launch summed
over the kernel's regions (the steady loops, the path between tiles, the producer), with each region's executed
instructions and its main stall reasons.

    python3 lab/tools/ncu_regions.py SOURCE_CSV [SOURCE_CSV ...]

SOURCE_CSV is the per-SASS-line source page that `tools/device_check.sh ncu` leaves in its ncu_*.tgz
(`ncu -i REPORT --page source --csv --print-source sass`). Samples are taken at a fixed rate per warp, so a
region's share of a warp class's samples is its share of that class's time: the consumer rows add up to the consumer
warps' whole time, the producer row to the producer warps'.

The regions are found from the SASS itself, in address order (ptxas lays the consumer path out as the kernel source
reads; checked on the D 128 kernels, lab/log/v24.md):
  the two steady loops: the innermost loops (backward branches) whose body holds at least 12 HGMMAs, the masked
  loop first;
  between tiles, after the unmasked loop: the next tile's decode, up to the tail turn's ping-pong BAR.SYNC (256
  threads); the tail turn, up to its PV wait (WARPGROUP.DEPBAR.LE gsb0, 0x1); the epilogue, up to the Q buffer's
  release (BAR.ARV of 288 threads); the next tile's first softmax, up to the branch back to the loops;
  the CTA's last tail and epilogue, up to the consumers' EXIT; the producer, from there to the last EXIT;
  the out-of-line retry loops of mbarrier waits after it count in the region they return to.
Everything before the masked loop is the kernel's start (setup, the first tile's first block: the ramp).
"""
import collections
import csv
import re
import sys

from sass_waits import branch_target, loops  # lab/tools/ is this script's directory

# HGMMAs per steady step: Q K^T takes D / 16 and P V kBlockN / 16, so 4 + 8 at D 64 on 128 x 128 tiles (the fewest of
# any kernel here) and 8 + 8 at D 128.
MIN_LOOP_HGMMAS = 12


def read(path):
    rows = list(csv.reader(open(path)))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names, data = rows[header], rows[header + 1:]
    col = {n: i for i, n in enumerate(names)}
    stalls = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    base = int(data[0][col["Address"]], 16)
    lines = []
    for r in data:
        lines.append({
            "offset": int(r[col["Address"]], 16) - base,
            "text": r[col["Source"]].strip(),
            "samples": int(r[col["Warp Stall Sampling (All Samples)"]] or 0),
            "executed": int(r[col["Instructions Executed"]] or 0),
            "stalls": {n[len("stall_"):]: int(r[col[n]] or 0) for n in stalls},
        })
    return lines, base


def regions(lines, base):
    """[(start offset, name)] in address order, and a function mapping a stub's offset to where it returns."""
    at = {l["offset"]: i for i, l in enumerate(lines)}
    target_of = lambda text: None if (t := branch_target(text)) is None else t - base
    exits = [l["offset"] for l in lines if re.search(r"\bEXIT\b", l["text"]) and "PREEXIT" not in l["text"]]
    last_exit = exits[-1]
    candidates = [(lines[first]["offset"], lines[last]["offset"])
                  for first, last in loops([(base + l["offset"], l["text"]) for l in lines])
                  if lines[last]["offset"] <= last_exit
                  and sum("HGMMA" in l["text"] for l in lines[first:last + 1]) >= MIN_LOOP_HGMMAS]
    # The steady loops are the innermost of those (the loop over tiles holds both).
    steady = sorted({(a, b) for a, b in candidates
                    if not any((a, b) != (c, d) and a <= c and d <= b for c, d in candidates)})
    if len(steady) < 2:
        sys.exit("ncu_regions: fewer than two steady loops found; not an sm90 forward kernel of the expected form")
    (masked_start, masked_end), (unmasked_start, unmasked_end) = steady[0], steady[1]

    def first_after(offset, pattern):
        for l in lines[at[offset] + 1:]:
            if re.search(pattern, l["text"]):
                return l["offset"]
        sys.exit(f"ncu_regions: no {pattern!r} after {offset:#x}")

    tail_turn = first_after(unmasked_end, r"BAR\.SYNC\S*\s+\S+,\s*0x100\b")
    pv_wait = first_after(tail_turn, r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b")
    back = next(l["offset"] for l in lines[at[pv_wait] + 1:]
                if (t := target_of(l["text"])) is not None and t < masked_start and "@" not in l["text"])
    # The epilogue ends at its last barrier: the Q buffer's release (BAR.ARV of the producer warp and every consumer
    # thread: 0x120 with two consumer warpgroups, 0x1a0 with three) where O is staged in the Q buffer, else the
    # warpgroup's sync after its O staging (BAR.SYNC of 128 threads; the Q buffer was released before the decode).
    ends = [l["offset"] for l in lines[at[pv_wait] + 1:at[back]]
            if re.search(r"BAR\.ARV\s+\S+,\s*0x(120|1a0)\b|BAR\.SYNC\S*\s+\S+,\s*0x80\b", l["text"])]
    if not ends:
        sys.exit(f"ncu_regions: no epilogue barrier between {pv_wait:#x} and {back:#x}")
    release = ends[-1]
    consumer_exit = next(o for o in exits if o > back)
    starts = [
        (0, "kernel start, first tile's first block"),
        (masked_start, "masked steady loop"),
        (masked_end + 1, "unmasked loop entry"),
        (unmasked_start, "unmasked steady loop"),
        (unmasked_end + 1, "between tiles: decode"),
        (tail_turn, "between tiles: tail turn"),
        (pv_wait, "between tiles: epilogue"),
        (release + 1, "between tiles: next tile's first softmax"),
        (back + 1, "last tile's tail and epilogue"),
        (consumer_exit + 1, "producer"),
        (last_exit + 1, "(retry loops)"),
    ]

    def region_of(offset):
        name = starts[0][1]
        for start, n in starts:
            if offset >= start:
                name = n
        return name

    # A retry loop after the last EXIT returns to its caller with an unconditional branch: count it there.
    stub_region = {}
    pending = []
    for l in lines:
        if l["offset"] <= last_exit:
            continue
        pending.append(l["offset"])
        target = target_of(l["text"])
        if target is not None and "@" not in l["text"] and target <= last_exit:
            for o in pending:
                stub_region[o] = region_of(target)
            pending = []
    return starts, lambda o: stub_region.get(o, region_of(o))


def attribute(path):
    """The regions in address order, and per region its samples, executed instructions and stall samples by reason."""
    lines, base = read(path)
    starts, region_of = regions(lines, base)
    samples, executed = collections.Counter(), collections.Counter()
    stalls = collections.defaultdict(collections.Counter)
    for l in lines:
        r = region_of(l["offset"])
        samples[r] += l["samples"]
        executed[r] += l["executed"]
        stalls[r].update(l["stalls"])
    return [name for _, name in starts], samples, executed, stalls


def report(path):
    names, samples, executed, stalls = attribute(path)
    consumer = sum(v for k, v in samples.items() if k not in ("producer", "(retry loops)"))
    print(f"{path}: {sum(samples.values())} samples, consumers {consumer}, producer {samples['producer']}")
    print(f"{'region':42s} {'samples':>8s} {'% class':>8s} {'executed':>11s}  top stall reasons")
    for name in names:
        if not samples[name] and not executed[name]:
            continue
        share = samples[name] / (samples[name] if name == "producer" else consumer) if samples[name] else 0
        top = ", ".join(f"{k} {v * 100 / samples[name]:.0f}%" for k, v in stalls[name].most_common(3) if v)
        print(f"{name:42s} {samples[name]:8d} {share * 100:7.1f}% {executed[name]:11d}  {top}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        report(p)
        print()
