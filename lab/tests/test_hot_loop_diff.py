"""lab/tools/hot_loop_diff.py on synthetic SASS dumps: it finds the hot loop of the named kernel (the smallest loop with
wgmmas and a vote and no -INF select), ignores branch targets, and calls a loop that differs only in its registers
different."""
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "hot_loop_diff.py"
KERNEL = "_ZN8flashjax4sm9015fwd_kernel_sm90INS0_13FwdKernelSm90IN7cutlass10bfloat16_tELi128ELi128ELi128ELb0ELb0ELb0EEEEEvNT_6ParamsE"


def dump(body, start=0x100, kernel=KERNEL, other_first=True, masked_loop=()):
    """cuobjdump-style text: an unrelated kernel first (it must be skipped), then `kernel` with an optional masked
    loop (`masked_loop`, looping onto itself) followed by the loop `body`."""
    lines = []
    if other_first:
        lines += ["\t\tFunction : _ZN8flashjax4sm9015other_kernelEv", "        /*0000*/                   NOP ;"]
    lines.append(f"\t\tFunction : {kernel}")
    address = start
    masked = list(masked_loop) + ([f"@P1 BRA 0x{start + 0x10:x}"] if masked_loop else [])
    body_start = start + 0x10 * (1 + len(masked))  # after the MOV and the masked loop
    for text in ["MOV R1, c[0x0][0x28]"] + masked + body + [f"@P0 BRA 0x{body_start:x}", "EXIT"]:
        lines.append(f"        /*{address:04x}*/                   {text} ;")
        lines.append("                                                                   /* 0x000000000000000 */")
        address += 0x10
    return "\n".join(lines) + "\n"


LOOP = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0"] * 16 + [
    "FFMA R10, R90, UR22, -R2", "MUFU.EX2 R10, R10", "FADD R11, R10, R11", "VOTE.ALL P0, P0"]


def run(tmp_path, a, b):
    (tmp_path / "a.sass").write_text(a)
    (tmp_path / "b.sass").write_text(b)
    out = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "a.sass"), str(tmp_path / "b.sass")],
                         capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def test_same_loop_at_other_addresses(tmp_path):
    rc, out = run(tmp_path, dump(LOOP), dump(LOOP, start=0x900, other_first=False))
    assert rc == 0 and "same hot loop" in out and "21 vs 21 instructions; in order, identical 21," in out


@pytest.mark.parametrize("changed, renamed", [("FFMA R12, R90, UR22, -R2", 21), ("FMUL R11, R10, R11", 20)])
def test_other_registers_or_opcodes_differ(tmp_path, changed, renamed):
    body = list(LOOP)
    body[16] = changed if changed.startswith("FFMA") else body[16]
    body[18] = changed if changed.startswith("FMUL") else body[18]
    rc, out = run(tmp_path, dump(LOOP), dump(body))
    assert rc == 0 and "different hot loop" in out
    assert "identical 20," in out and f"identical but for registers {renamed}," in out


def test_a_smaller_masked_loop_is_not_the_hot_loop(tmp_path):
    masked = (["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0"]
              + [f"FSEL R{90 + i}, R{90 + i}, -INF , !P0" for i in range(8)] + ["VOTE.ANY R2, PT, P0"])
    rc, out = run(tmp_path, dump(LOOP, masked_loop=masked), dump(LOOP))
    assert rc == 0 and "same hot loop" in out and "21 vs 21 instructions" in out


def test_a_few_minus_inf_selects_do_not_make_a_mask(tmp_path):
    """An unmasked loop's fallback softmax may select -INF a few times (lab/experiments/v29-shared-reference.patch's
    reset of its shared reference does once)."""
    body = LOOP[:-1] + ["FSEL R5, R6, -INF , P1", "VOTE.ALL P0, P0"]
    rc, out = run(tmp_path, dump(body), dump(body, start=0x900))
    assert rc == 0 and "same hot loop" in out and "22 vs 22 instructions" in out


def test_no_hot_loop(tmp_path):
    rc, out = run(tmp_path, dump([t for t in LOOP if not t.startswith("VOTE")]), dump(LOOP))
    assert rc != 0 and "no unmasked loop with wgmmas and a vote" in out


def fingerprint(tmp_path, text, expect=None):
    (tmp_path / "a.sass").write_text(text)
    command = [sys.executable, str(TOOL), str(tmp_path / "a.sass"), "--fingerprint"]
    if expect is not None:
        (tmp_path / "fingerprint.txt").write_text(f"# a comment\n\n{expect} some build\n")
        command += ["--expect", str(tmp_path / "fingerprint.txt")]
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_fingerprint_names_the_loop_not_its_addresses(tmp_path):
    first = fingerprint(tmp_path, dump(LOOP)).split()[3]
    assert fingerprint(tmp_path, dump(LOOP, start=0x900, other_first=False)).split()[3] == first
    renamed = list(LOOP)
    renamed[16] = "FFMA R12, R90, UR22, -R2"  # the same loop but for one register
    assert fingerprint(tmp_path, dump(renamed)).split()[3] != first
    assert "(21 instructions, " in fingerprint(tmp_path, dump(LOOP))


def test_fingerprint_against_the_recorded_one(tmp_path):
    recorded = fingerprint(tmp_path, dump(LOOP)).split()[3]
    assert "the recorded hot loop" in fingerprint(tmp_path, dump(LOOP), expect=recorded)
    renamed = list(LOOP)
    renamed[18] = "FADD R11, R10, R13"
    out = fingerprint(tmp_path, dump(renamed), expect=recorded)
    assert f"not the recorded hot loop ({recorded})" in out


def test_one_build_needs_fingerprint(tmp_path):
    (tmp_path / "a.sass").write_text(dump(LOOP))
    out = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "a.sass")], capture_output=True, text=True)
    assert out.returncode != 0 and "two builds to compare, or --fingerprint" in out.stderr


def test_the_bf16_kernel_is_found_behind_the_fp16_one(tmp_path):
    """A full kernel-set build lists the fp16 kernel of the same shape first: the default pattern must skip it."""
    fp16 = KERNEL.replace("10bfloat16_t", "6half_t")
    other = list(LOOP)
    other[16] = "FFMA R12, R90, UR22, -R2"  # the fp16 kernel's loop, another allocation
    text = dump(other, kernel=fp16) + dump(LOOP, other_first=False)
    assert fingerprint(tmp_path, text).split()[3] == fingerprint(tmp_path, dump(LOOP)).split()[3]


@pytest.mark.parametrize("ffma, reads", [("FFMA R10, R90, UR22, -R2", 1), ("FFMA R10, R90, UR22, -R2.reuse", 0),
                                         ("FFMA R10, R90, UR22, -R3", 0), ("@!P1 FFMA R11, R91, UR22, -R3", 1)])
def test_same_parity_reads(tmp_path, ffma, reads):
    """Two general-register sources of one parity and neither reused count once (uniform registers, the target
    and the wgmmas' accumulators do not); both modes print the count."""
    body = list(LOOP)
    body[16] = ffma
    assert f"(21 instructions, {reads} same-parity reads)" in fingerprint(tmp_path, dump(body))
    rc, out = run(tmp_path, dump(LOOP), dump(body))
    assert rc == 0 and f"same-parity reads 1 vs {reads}" in out
