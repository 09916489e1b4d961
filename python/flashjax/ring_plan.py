"""Which attention calls each device of a ring makes at each step: pure Python, decided when ring.py is traced.

A device holds its queries and, at step t of n, the key/value block that started on device (i - t) mod n. Each of the
two is a few pieces of the global sequence: one in the contiguous layout, chunks i and 2n-1-i in the zigzag layout.
The global mask (docs/design.md §2.3, bottom-right aligned over the whole sequences) restricted to the block pair is
a band in local coordinates wherever the pieces line up, and flash_attn draws any band that contains its own
bottom-right diagonal. So the plan tries to cover the block pair with few calls: the whole block, the whole queries
against each key piece, each query piece against the whole block, and last each piece pair (always a band). Each
call is then cut to the tight box of its visible entries (rows that see no key are left out, keys no row sees are
dropped): in the tight box the band always contains the box's bottom-right diagonal, so it is a flash_attn window.
Nothing here is a second mask policy: it only chooses the slices and windows of calls to flash_attn, which applies
the one policy.
"""
from __future__ import annotations

import dataclasses
import math

LAYOUTS = ("contiguous", "zigzag")
_INF = math.inf


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """flash_attn(q[:, q_start:q_stop], k[:, k_start:k_stop], v[...], window_size=window) on local rows."""
    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    window: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Step:
    """The distinct cases of one ring step (each a tuple of calls, possibly empty) and which case each device runs."""
    cases: tuple[tuple[BlockCall, ...], ...]
    case_of: tuple[int, ...]


def pieces(layout: str, ring_size: int, device: int, length: int) -> list[tuple[int, int, int]]:
    """The global pieces a device holds of a sequence of ring_size * length: (local start, global start, length)."""
    if layout == "contiguous":
        return [(0, device * length, length)]
    half = length // 2  # zigzag: chunks `device` and 2n-1-device of 2n
    return [(0, device * half, half), (half, (2 * ring_size - 1 - device) * half, half)]


def _restrict(band, rows, cols):
    """The band [lo, hi] on d = col - row as it shows in a rectangle (every d between its extremes occurs there): an
    interval, or None when nothing is visible."""
    lo = max(band[0], cols[0] - (rows[1] - 1))
    hi = min(band[1], (cols[1] - 1) - rows[0])
    return (lo, hi) if lo <= hi else None


def _group_band(pairs):
    """One local band [lo, hi] that shows as each (rows, cols, band) pair's own band, or None if there is none."""
    los = {-_INF} | {band[0] for _, _, band in pairs}
    his = {_INF} | {band[1] for _, _, band in pairs}
    for lo in sorted(los):
        for hi in sorted(his, reverse=True):
            if all(_restrict((lo, hi), rows, cols) == _restrict(band, rows, cols) for rows, cols, band in pairs):
                return lo, hi
    return None


def _tight_call(band, rows, cols):
    """The call that computes the band over a rectangle: cut to its visible entries, the band as a window of the cut
    block (left, right; -1 unbounded). None when nothing is visible."""
    lo, hi = band
    if _restrict(band, rows, cols) is None:
        return None
    r0, r1 = max(rows[0], cols[0] - hi), min(rows[1], cols[1] - lo)      # rows that see a key
    c0, c1 = max(cols[0], rows[0] + lo), min(cols[1], rows[1] + hi)      # keys that a row sees
    r0, r1, c0, c1 = (int(x) for x in (r0, r1, c0, c1))
    diagonal = (c1 - c0) - (r1 - r0)  # the cut block's bottom-right diagonal, in its own d = col - row
    shift = c0 - r0
    right = -1 if hi - shift >= (c1 - c0) - 1 else int(hi - shift - diagonal)
    left = -1 if lo - shift <= -((r1 - r0) - 1) else int(diagonal - (lo - shift))
    assert right >= -1 and left >= -1, (band, rows, cols)  # the tight box always holds its diagonal
    return BlockCall(r0, r1, c0, c1, (left, right))


def block_calls(q_pieces, k_pieces, offset: int, window: tuple[int, int]) -> tuple[BlockCall, ...]:
    """The calls that compute queries `q_pieces` against keys `k_pieces` (lists of (local start, global start,
    length)) under the global band: key j visible to query i iff i + offset - left <= j <= i + offset + right."""
    left, right = window
    band = (offset - left if left >= 0 else -_INF, offset + right if right >= 0 else _INF)
    q_pieces = [p for p in q_pieces if p[2] > 0]
    k_pieces = [p for p in k_pieces if p[2] > 0]

    def pair(qp, kp):  # local d = global d - shift, shift = (global - local start of k) - (that of q)
        shift = (kp[1] - kp[0]) - (qp[1] - qp[0])
        return (qp[0], qp[0] + qp[2]), (kp[0], kp[0] + kp[2]), (band[0] - shift, band[1] - shift)

    def calls_of(groups):
        calls = []
        for qs, ks in groups:
            pairs = [pair(qp, kp) for qp in qs for kp in ks]
            local = _group_band(pairs)
            if local is None:
                return None
            rows = (min(p[0] for p in qs), max(p[0] + p[2] for p in qs))
            cols = (min(p[0] for p in ks), max(p[0] + p[2] for p in ks))
            call = _tight_call(local, rows, cols)
            if call is not None:
                calls.append(call)
        return tuple(calls)

    if not q_pieces or not k_pieces:
        return ()
    # Pieces of one device are contiguous in local order, so any run of them is a slice.
    groupings = [[(q_pieces, k_pieces)], [(q_pieces, [kp]) for kp in k_pieces], [([qp], k_pieces) for qp in q_pieces],
                 [([qp], [kp]) for qp in q_pieces for kp in k_pieces]]
    options = [c for c in map(calls_of, groupings) if c is not None]  # the last grouping always works
    return min(options, key=len)


def schedule(layout: str, ring_size: int, len_q: int, len_k: int, window: tuple[int, int]) -> tuple[Step, ...]:
    """Per step, the calls of every device: queries of len_q and key blocks of len_k per device, the global
    sequences ring_size times longer (offset = Sk - Sq over the whole sequences, §2.3)."""
    offset = ring_size * (len_k - len_q)
    steps = []
    for t in range(ring_size):
        cases, case_of = [], []
        for device in range(ring_size):
            source = (device - t) % ring_size
            calls = block_calls(pieces(layout, ring_size, device, len_q), pieces(layout, ring_size, source, len_k),
                                offset, window)
            if calls not in cases:
                cases.append(calls)
            case_of.append(cases.index(calls))
        steps.append(Step(tuple(cases), tuple(case_of)))
    return tuple(steps)
