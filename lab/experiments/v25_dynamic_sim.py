"""lab/log/v25.md: how evenly tiles handed out at run time would spread the causal S 4k grid row (B 4, H 16, 32
m-blocks of 128 rows, 132 CTAs) over the CTAs, in the planner's cost model (5 per KV block + 8 per tile).

The order is the kernel's: the bulk in (heavy, light) pairs per head-batch, then the planned tail as one list,
heaviest first. Each CTA takes the next tile when it has `lookahead` of its current tile left (the kernel's producer
takes it with ~3 KV blocks left, and holds it through its Q load). `jitter` scales each CTA's speed by up to
+-jitter, for SMs that run at different speeds. Prints the busiest and idlest CTA against the mean, which is what
the static plan is judged by (tests/cpp/test_tile_scheduler.cu: <= 1.005 in this model).

    python3 lab/experiments/v25_dynamic_sim.py
"""
import heapq
import random

BATCH, HEADS, SEQLEN, BLOCK, GRID = 4, 16, 4096, 128, 132
NUM_M = SEQLEN // BLOCK
HEAD_BATCHES = BATCH * HEADS


def cost(blocks):
    return 5 * blocks + 8


def tile_order(tail_head_batches):
    """KV blocks of each tile in the order the positions are handed out."""
    order = []
    for position in range((HEAD_BATCHES - tail_head_batches) * NUM_M):
        index = position % NUM_M
        rank = index // 2 if index % 2 == 0 else NUM_M - 1 - index // 2  # heavy, light, heavy, ...
        order.append(NUM_M - rank)  # rank r: the r-th heaviest m-block, which sees NUM_M - r blocks
    for blocks in range(NUM_M, 0, -1):  # the tail, heaviest first
        order += [blocks] * tail_head_batches
    return order


def run_time_handout(order, lookahead, jitter, seed=1):
    rng = random.Random(seed)
    speed = [1 + jitter * rng.uniform(-1, 1) for _ in range(GRID)]
    finish = [0.0] * GRID
    ready = []  # (when the CTA takes its next tile, CTA)
    for cta, blocks in zip(range(GRID), order):
        finish[cta] = cost(blocks) * speed[cta]
        heapq.heappush(ready, (finish[cta] - lookahead * cost(blocks) * speed[cta], cta))
    for blocks in order[GRID:]:
        _, cta = heapq.heappop(ready)
        finish[cta] += cost(blocks) * speed[cta]
        heapq.heappush(ready, (finish[cta] - lookahead * cost(blocks) * speed[cta], cta))
    mean = sum(finish) / GRID
    return max(finish) / mean, min(finish) / mean


def main():
    for tail in (8, 10, 12):
        for lookahead in (0.0, 0.5, 1.0):
            for jitter in (0.0, 0.03):
                busiest, idlest = run_time_handout(tile_order(tail), lookahead, jitter)
                print(f"tail {tail:2d} head-batches, lookahead {lookahead:.1f} tile, jitter {jitter:.2f}: "
                      f"busiest {busiest:.4f}, idlest {idlest:.4f} of the mean")


if __name__ == "__main__":
    main()
