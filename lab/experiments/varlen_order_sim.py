"""Issue 37 bar 6a: how the sm90 varlen forward's walk order spreads causal packed sequences over the CTAs, in the
dense planner's cost model (fwd_tile_scheduler.cuh: 5 per KV block + 8 per tile with work, 1 per tile without).

A walk is a list of tiles (virtual block, head) in the order of positions; the kernel hands positions out round
robin (CTA c takes c, c + grid, ...: static, no device counter), so each order is simulated that way ("static"),
and for reference as a run-time hand-out ("greedy": each CTA takes the walk's next tile when it finishes, which
needs a zeroed device counter per launch). Printed: the busiest CTA over the mean CTA (1.00 is perfect balance),
mean over 20 random packings, and the worst one.

    python3 lab/experiments/varlen_order_sim.py
"""
import heapq
import random

BLOCK_M = BLOCK_N = 128  # D 128's varlen tiles (kFew: 128 x 128)
HEADS, GRID = 16, 132


def cost(blocks):
    return 5 * blocks + 8 if blocks > 0 else 1


def sequence_blocks(lengths):
    """Per sequence: its virtual blocks (first virtual block, blocks with rows, virtual blocks it owns) as
    kernels/common/varlen.cuh numbers them, and the KV blocks of each of its row blocks (causal, Sq = Sk)."""
    seqs, start = [], 0
    for b, length in enumerate(lengths):
        first = start // BLOCK_M + b
        seqs.append((first, length))
        start += length
    total = start
    num_blocks = total // BLOCK_M + len(lengths)
    return seqs, num_blocks


def virtual_block_costs(lengths):
    """cost of each virtual block of one head (blocks past a sequence's rows: no work)."""
    seqs, num_blocks = sequence_blocks(lengths)
    costs = [cost(0)] * num_blocks
    for first, length in seqs:
        for m in range((length + BLOCK_M - 1) // BLOCK_M):
            last_row = min((m + 1) * BLOCK_M, length) - 1
            costs[first + m] = cost(last_row // BLOCK_N + 1)  # causal, bottom-right = top-left when Sq = Sk
    return costs, seqs, num_blocks


def walk(lengths, order):
    """Costs of the tiles in walk order."""
    costs, seqs, num_blocks = virtual_block_costs(lengths)
    owner = [0] * num_blocks  # virtual block -> (first, end) of the blocks its sequence owns
    bounds = [first for first, _ in seqs] + [num_blocks]
    for b in range(len(seqs)):
        for v in range(bounds[b], bounds[b + 1]):
            owner[v] = (bounds[b], bounds[b + 1])

    def mirrored(v):
        # "reverse": each sequence's virtual blocks last to first. The sequence's owned range [first, end) holds its
        # row blocks at its start and at most one extra (empty) block at its end: mirroring by the row blocks
        # (ceil(len / M)) needs the length, which the walk has on the device (the sequence's offsets).
        first, end = owner[v]
        b = bounds.index(first)
        rows = (seqs[b][1] + BLOCK_M - 1) // BLOCK_M
        m = v - first
        return first + (rows - 1 - m) if m < rows else v

    tiles = []
    if order == "current":  # blocks fastest, first to last, head slowest
        tiles = [costs[v] for h in range(HEADS) for v in range(num_blocks)]
    elif order == "reverse":  # each sequence's blocks last to first
        tiles = [costs[mirrored(v)] for h in range(HEADS) for v in range(num_blocks)]
    elif order == "reverse-walk":  # the whole walk last to first (last sequence's last block first)
        tiles = [costs[v] for h in range(HEADS) for v in reversed(range(num_blocks))]
    elif order == "sorted":  # every tile heaviest first (what a device-side sort into a workspace would give)
        tiles = sorted((costs[v] for h in range(HEADS) for v in range(num_blocks)), reverse=True)
    return tiles


def static_round_robin(tiles, snake=False):
    load = [0] * GRID
    for p, c in enumerate(tiles):
        r, i = divmod(p, GRID)
        cta = GRID - 1 - i if snake and r % 2 else i
        load[cta] += c
    return load


def cost_partition(tiles, model=None):
    """The shipped walk (fwd_varlen_scheduler.cuh): CTA c takes the contiguous positions whose modelled cost midpoint
    lies in [c W / G, (c + 1) W / G), W the walk's modelled cost; `model` the modelled costs (default: the true
    ones), the loads are the true ones."""
    model = model or tiles
    total = sum(model)
    load = [0] * GRID
    before = 0
    for c, m in zip(tiles, model):
        cta = min(GRID - 1, (2 * before + m) * GRID // (2 * total))
        load[cta] += c
        before += m
    return load


def interpolated(lengths):
    """The device's model of a tile's cost: per sequence, exact for its first and last row block and linear between
    (exact for causal Sq = Sk with kBlockM = kBlockN), 1 per virtual block without rows; current order."""
    costs, seqs, num_blocks = virtual_block_costs(lengths)
    model = [cost(0)] * num_blocks
    for first, length in seqs:
        n = (length + BLOCK_M - 1) // BLOCK_M
        if n == 0:
            continue
        c0, c1 = costs[first], costs[first + n - 1]
        for m in range(n):
            model[first + m] = c0 + (c1 - c0) * m // max(n - 1, 1)
    return [model[v] for h in range(HEADS) for v in range(num_blocks)]


def greedy(tiles):
    ready = [(0, cta) for cta in range(GRID)]
    load = [0] * GRID
    for c in tiles:
        t, cta = heapq.heappop(ready)
        load[cta] = t + c
        heapq.heappush(ready, (t + c, cta))
    return load


def imbalance(load):
    return max(load) / (sum(load) / len(load))


def dense_equal(lengths):
    """bench/varlen.py's dense comparison: sequences of length sqrt(mean len^2) with the same FLOPs; the dense
    scheduler's pairs + planned tail put it at ~1.00-1.03 in this model (tests/cpp/test_tile_scheduler.cu)."""
    length = round((sum(x * x for x in lengths) / len(lengths)) ** 0.5)
    batch = round(sum(x * x for x in lengths) / length ** 2)
    m_blocks = (length + BLOCK_M - 1) // BLOCK_M
    work = batch * HEADS * sum(cost(min((m + 1) * BLOCK_M, length) // BLOCK_N + 1) for m in range(m_blocks))
    return work


def main():
    rows = [("pack64-1..1024", 64, 1, 1024), ("pack1000-0..512", 1000, 0, 512)]
    variants = [("current", False), ("reverse", False), ("reverse-walk", False), ("current", True),
                ("reverse", True), ("sorted", True)]
    for name, n, lo, hi in rows:
        print(f"{name}: busiest CTA / mean CTA (mean over 20 packings, worst); work vs dense-equal's")
        results = {}
        work_ratio = []
        for seed in range(20):
            rng = random.Random(seed)
            lengths = [rng.randint(lo, hi) for _ in range(n)]
            for order, snake in variants:
                tiles = walk(lengths, order)
                key = order + (" +snake" if snake else "")
                results.setdefault(("static", key), []).append(imbalance(static_round_robin(tiles, snake)))
                if not snake:
                    results.setdefault(("greedy", key), []).append(imbalance(greedy(tiles)))
            tiles = walk(lengths, "current")
            results.setdefault(("static", "cost partition"), []).append(
                imbalance(cost_partition(tiles, interpolated(lengths))))
            work_ratio.append(sum(walk(lengths, "current")) / dense_equal(lengths))
        for (mode, key), values in results.items():
            print(f"  {mode:6s} {key:20s} mean {sum(values) / len(values):.3f}  worst {max(values):.3f}")
        print(f"  varlen tiles' modelled work / dense-equal's: {sum(work_ratio) / len(work_ratio):.3f}")


if __name__ == "__main__":
    main()
