"""The sm90 forward's host plan for causal aligned calls, replayed against measured per-CTA timelines (lab/log/v27.md).

A Python replica of FwdTileSchedulerSm90's plan (the bulk dealt in (heavy, light) pairs, the tail packed longest
first), checked against the tile lists a probe build recorded (lab/tools/cta_timeline.py's .npy), then used to predict
each CTA's exit from its start, its tiles' cycles (fitted from the records) and its SM's clock, for other plans:
  python lab/experiments/v27_plan_sim.py RECORDS.npy [--num-m 32 --head-batches 64]
"""
import argparse
import heapq
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from cta_timeline import (AFTER_WAIT, CLOCK_ENTRY, CLOCK_EXIT, ENTRY, EXIT, tile_blocks,  # noqa: E402
                          tile_ends)


def bulk_m(p, num_m):
    index, half = p % num_m, (p % num_m) >> 1
    rank = half if index % 2 == 0 else num_m - 1 - half
    return num_m - 1 - rank  # causal: the last m-block is the heaviest


def improve(loads, tails, cost):
    """Moves or swaps of tail tiles off the busiest CTA while its load drops."""
    while True:
        c, best = int(np.argmax(loads)), None
        for d in range(len(loads)):
            if d == c:
                continue
            for i, m in enumerate(tails[c]):
                options = [(cost[m], None)] + [(cost[m] - cost[m2], j) for j, m2 in enumerate(tails[d])]
                for delta, j in options:
                    if delta > 0 and max(loads[c] - delta, loads[d] + delta) < (best or (loads[c],))[0]:
                        best = (max(loads[c] - delta, loads[d] + delta), d, i, j, delta)
        if best is None:
            return
        _, d, i, j, delta = best
        if j is None:
            tails[d].append(tails[c].pop(i))
        else:
            tails[c][i], tails[d][j] = tails[d][j], tails[c][i]
        loads[c] -= delta
        loads[d] += delta


def plan(num_m, head_batches, grid, cost, tail_sizes=None, local_search=False):
    most = min(head_batches, 896 // num_m)
    fewest = min(most, -(-2 * grid // num_m))
    best = None
    for tail in tail_sizes or range(fewest, min(most, fewest + 4) + 1):
        loads, lists = np.zeros(grid), [[] for _ in range(grid)]
        for p in range((head_batches - tail) * num_m):
            c, m = (p >> 1) % grid, bulk_m(p, num_m)
            loads[c] += cost[m]
            lists[c].append(m)
        heap = [(loads[c], c) for c in range(grid)]
        heapq.heapify(heap)
        tails = [[] for _ in range(grid)]
        for m in sorted(range(num_m), key=lambda m: -cost[m]):
            for _ in range(tail):
                load, c = heapq.heappop(heap)
                loads[c] = load + cost[m]
                tails[c].append(m)
                heapq.heappush(heap, (loads[c], c))
        if local_search:
            improve(loads, tails, cost)
        if best is None or loads.max() < best[0]:
            best = (loads.max(), tail, [a + b for a, b in zip(lists, tails)])
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("records")
    p.add_argument("--num-m", type=int, default=32)
    p.add_argument("--head-batches", type=int, default=64)
    args = p.parse_args()
    rec = np.load(args.records).astype(np.int64)
    launches = [l for l in range(rec.shape[0]) if (rec[l, :, EXIT] > 0).any()][1:]
    grid = int((rec[launches[0], :, EXIT] > 0).sum())
    num_m = args.num_m
    start, end, clock, per_tile = np.zeros(grid), np.zeros(grid), np.zeros(grid), []
    for l in launches:
        t0 = rec[l, :grid, AFTER_WAIT].min()
        for c in range(grid):
            r = rec[l, c]
            blocks, ends = tile_blocks(r), tile_ends(r)
            ghz = (r[CLOCK_EXIT] - r[CLOCK_ENTRY]) / (r[EXIT] - r[ENTRY])
            clock[c] += ghz / len(launches)
            start[c] += (r[AFTER_WAIT] - t0) / len(launches)
            end[c] += (r[EXIT] - t0) / len(launches)
            per_tile += [(blocks[k], (ends[k] - ends[k - 1]) * ghz) for k in range(1, len(ends))]
    t = np.array(per_tile, float)
    (per_block, per_tile_cost), *_ = np.linalg.lstsq(np.stack([t[:, 0], np.ones(len(t))], 1), t[:, 1], rcond=None)
    true = [per_block * (m + 1) + per_tile_cost for m in range(num_m)]
    main_cost = [5 * (m + 1) + 8 for m in range(num_m)]
    _, _, lists = plan(num_m, args.head_batches, grid, main_cost)
    recorded = [tile_blocks(rec[launches[0], c]).tolist() for c in range(grid)]
    print(f"replica matches the recorded tile lists of {sum(r == [m + 1 for m in l] for r, l in zip(recorded, lists))}"
          f" of {grid} CTAs")
    cycles = lambda lists: np.array([sum(true[m] for m in l) for l in lists])
    extra = np.median((end - start) * clock - cycles(lists))  # the first tile's start-up, per CTA
    predict = lambda lists: start + (cycles(lists) + extra) / clock
    print(f"tile cycles: {per_block:.0f} per block + {per_tile_cost:.0f} per tile; measured makespan "
          f"{end.max() / 1e3:.1f} us, mean CTA exit {end.mean() / 1e3:.1f} us")
    total = cycles(lists).sum() + grid * extra
    print(f"fluid (all work spread over the CTAs' clocks): {(total + (start * clock).sum()) / clock.sum() / 1e3:.1f} us")
    for name, cost, sizes, search in [("main (5/block + 8/tile)", main_cost, None, False),
                                      ("5 + 7, moves and swaps, tails 5-20", [5 * (m + 1) + 7 for m in range(num_m)],
                                       range(5, 21), True)]:
        top, tail, lists = plan(num_m, args.head_batches, grid, cost, sizes, search)
        model = np.array([sum(cost[m] for m in l) for l in lists])
        print(f"{name}: tail {tail} head-batches, model max / mean {model.max() / model.mean():.4f}, predicted "
              f"makespan {predict(lists).max() / 1e3:.1f} us")
    # The tail handed out at run time, longest first, to whichever CTA is free (the bulk as planned).
    _, tail, lists = plan(num_m, args.head_batches, grid, main_cost)
    bulk_tiles = (args.head_batches - tail) * num_m
    bulk = [[] for _ in range(grid)]
    for p in range(bulk_tiles):
        bulk[(p >> 1) % grid].append(bulk_m(p, num_m))
    free = [(start[c] + (cycles([bulk[c]])[0] + extra) / clock[c], c) for c in range(grid)]
    heapq.heapify(free)
    finish = np.array([f for f, _ in sorted(free, key=lambda x: x[1])])
    for m in sorted([m for m in range(num_m) for _ in range(tail)], key=lambda m: -true[m]):
        f, c = heapq.heappop(free)
        finish[c] = f + true[m] / clock[c]
        heapq.heappush(free, (finish[c], c))
    print(f"tail handed out at run time: predicted makespan {finish.max() / 1e3:.1f} us")


if __name__ == "__main__":
    main()
