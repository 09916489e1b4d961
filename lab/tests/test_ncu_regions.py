"""lab/tools/ncu_regions.py on a synthetic ncu source page laid out like the sm90 forward kernel: each region's samples
are summed where the SASS landmarks put them, and a retry loop after the last EXIT counts in the region it returns to."""
import csv
import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ncu_regions.py"
sys.path.insert(0, str(TOOL.parent))  # the tool imports its SASS helpers (sass_waits) from there
spec = importlib.util.spec_from_file_location("ncu_regions", TOOL)
ncu_regions = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_regions)

BASE = 0x7F0000000000
HGMMAS = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT"] * 16


def listing():
    """(text, samples, region it belongs to) in address order; branch targets are filled in by address below."""
    rows = [("LDC R1, c[0x0][0x28]", 3, "kernel start, first tile's first block"),
            ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR7+0x38050], R2", 0, "kernel start, first tile's first block"),
            ("@!P0 BRA stub", 0, "kernel start, first tile's first block")]
    rows += [(t, 1, "masked steady loop") for t in ["BAR.SYNC.DEFER_BLOCKING R4, 0x100"] + HGMMAS]
    rows += [("@!P0 BRA masked", 1, "masked steady loop"), ("ISETP.NE.AND P0, PT, R2, RZ, PT", 5, "unmasked loop entry")]
    rows += [(t, 2, "unmasked steady loop") for t in ["BAR.SYNC.DEFER_BLOCKING R2, 0x100"] + HGMMAS + ["VOTE.ALL P0, P0"]]
    rows += [("@!P0 BRA unmasked", 2, "unmasked steady loop"),
             ("ULDC UR9, c[0x0][0x990]", 7, "between tiles: decode"),
             ("BAR.SYNC.DEFER_BLOCKING R3, 0x100", 11, "between tiles: tail turn"),
             ("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT", 1, "between tiles: tail turn"),
             ("WARPGROUP.DEPBAR.LE gsb0, 0x1", 13, "between tiles: epilogue"),
             ("STSM.16.M88.4 [R38], R12", 1, "between tiles: epilogue"),
             ("BAR.ARV R2, 0x120", 17, "between tiles: epilogue"),
             ("MUFU.EX2 R5, R2", 19, "between tiles: next tile's first softmax"),
             ("BRA dispatch", 1, "between tiles: next tile's first softmax"),
             ("UTMASTG.4D [UR16], [UR32]", 23, "last tile's tail and epilogue"),
             ("EXIT", 1, "last tile's tail and epilogue"),
             ("UTMALDG.4D [UR8], [UR16], desc[UR18]", 29, "producer"),
             ("EXIT", 1, "producer"),
             # The first tile's Q wait, out of line: it returns into the kernel start.
             ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ+0x38050], R2", 31, "kernel start, first tile's first block"),
             ("@!P0 BRA stub", 0, "kernel start, first tile's first block"),
             ("BRA back", 0, "kernel start, first tile's first block")]
    return rows


def write_csv(path, rows):
    first = lambda region: next(i for i, r in enumerate(rows) if r[2] == region)
    labels = {"stub": len(rows) - 3, "back": 2, "dispatch": 1, "masked": first("masked steady loop"),
              "unmasked": first("unmasked steady loop")}
    address = lambda i: BASE + 0x10 * i
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "fwd_kernel_sm90"])
        w.writerow(header)
        for i, (text, samples, _) in enumerate(rows):
            for label, target in labels.items():
                text = text.replace(f"BRA {label}", f"BRA 0x{address(target):x}")
            w.writerow([f"0x{address(i):x}", "      " + text, samples, 10, samples])


def attributed(tmp_path, rows):
    """ncu_regions' attribution of the listing, after checking that every region got exactly its rows' samples."""
    write_csv(tmp_path / "source.csv", rows)
    names, samples, executed, stalls = ncu_regions.attribute(str(tmp_path / "source.csv"))
    want = {}
    for _, s, region in rows:
        want[region] = want.get(region, 0) + s
    assert {k: v for k, v in samples.items() if v} == {k: v for k, v in want.items() if v}
    return names, want, stalls


def test_samples_land_in_their_regions(tmp_path):
    names, want, stalls = attributed(tmp_path, listing())
    assert names.index("unmasked steady loop") < names.index("between tiles: epilogue") < names.index("producer")
    assert stalls["producer"]["wait"] == want["producer"]


def test_a_kernel_without_two_steady_loops_is_refused(tmp_path):
    rows = [r for r in listing() if not (r[2] == "masked steady loop" and "HGMMA" in r[0])]  # a loop, no GEMMs
    write_csv(tmp_path / "source.csv", rows)
    with pytest.raises(SystemExit):
        ncu_regions.attribute(str(tmp_path / "source.csv"))


def own_o_listing():
    """The layout of a kernel with O's own staging buffer and 12 HGMMAs a step (D 64 on 128 x 128 tiles): the Q
    buffer is released right after the unmasked loop, and the epilogue ends at the warpgroup's 128-thread sync."""
    rows = []
    for text, samples, region in listing():
        if text.startswith("HGMMA") and region in ("masked steady loop", "unmasked steady loop"):
            if sum(r[0].startswith("HGMMA") and r[2] == region for r in rows) >= 12:
                continue
        if text == "BAR.ARV R2, 0x120":
            continue
        rows.append((text, samples, region))
        if text == "@!P0 BRA unmasked":
            rows.append(("BAR.ARV R8, 0x120", 37, "between tiles: decode"))
        if text == "STSM.16.M88.4 [R38], R12":
            rows.append(("BAR.SYNC.DEFER_BLOCKING R22, 0x80", 41, "between tiles: epilogue"))
    return rows


def test_an_own_o_buffer_kernel_ends_its_epilogue_at_the_warpgroup_sync(tmp_path):
    rows = own_o_listing()
    assert sum(r[0].startswith("HGMMA") and r[2] == "unmasked steady loop" for r in rows) == 12
    attributed(tmp_path, rows)
