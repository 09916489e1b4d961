// The dynamic varlen walk's hand-off (csrc/kernels/sm90/fwd_varlen_ring.cuh) run on the host: a few CTAs share one
// ticket counter; in each, the fetching warp and the reading warps step through the ring protocol (the kernel's slot
// and parity arithmetic, on a model of the mbarriers: parity waits, arrival counts) under random interleavings, with
// the kernel's data dependences between them: the fetcher loads a tile with work only once the consumers have freed
// its Q buffer (two buffers), a consumer finishes a tile only once it is loaded, the V warp loads a tile only once
// its Q has landed and the consumers have freed its V stage (two). Every reading warp must see exactly the fetcher's
// positions, in order, ending with the sentinel; the CTAs together visit every position once; nothing deadlocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <random>
#include <vector>

#include "kernels/sm90/fwd_varlen_ring.cuh"

namespace flashjax::sm90 {
namespace {

using Ring = VarlenTicketRing;

// An mbarrier as the ring uses it: a phase completes after `count` arrivals; a wait on parity P passes while the
// current phase's parity differs from P (the phase of parity P is the last completed one).
struct Barrier {
  int count = 1, pending = 1, phase = 0;
  void init(int n) { count = pending = n; }
  void arrive() {
    if (--pending == 0) {
      ++phase;
      pending = count;
    }
  }
  bool passes(uint32_t parity) const { return uint32_t(phase & 1) != parity; }
};

struct Cta {
  Barrier full[Ring::kDepth], empty[Ring::kDepth];
  int slots[Ring::kDepth] = {};
  std::vector<int> fetched;  // positions in walk order, as the fetcher published them (the first: its index)
  int loaded = 0;            // tiles with work whose Q/K the fetcher issued
  int landed_v = 0;          // tiles with work whose V the V warp issued
};

// One walking warp: its count of ring slots, where it stands in the walk, what it saw.
struct Walker {
  enum Kind { kFetcher, kVWarp, kConsumer } kind;
  int n = 0;              // ring slots fetched or read
  int position = 0;       // current position (num_tiles: done)
  int work_index = 0;     // tiles with work it has passed
  bool ticket_drawn = false;
  int ticket = 0;
  std::vector<int> seen;  // positions in walk order
};

TEST(VarlenRing, EveryWarpSeesTheFetchersPositions) {
  std::mt19937 rng(90);
  for (int trial = 0; trial < 300; ++trial) {
    const int grid = 1 + int(rng() % 4);
    const int num_tiles = grid + int(rng() % 40);
    const int consumers = 8 + 4 * int(rng() % 2);  // consumer warps: two or three warpgroups
    std::vector<bool> has_work(num_tiles);
    const int empty_every = 1 + int(rng() % 5);  // runs of positions without work, up to every position
    for (int p = 0; p < num_tiles; ++p) has_work[p] = int(rng() % empty_every) != 0;
    int counter = 0;
    std::vector<Cta> ctas(grid);
    std::vector<std::vector<Walker>> walkers(grid);
    for (int c = 0; c < grid; ++c) {
      for (auto& b : ctas[c].full) b.init(1);
      for (auto& b : ctas[c].empty) b.init(1 + consumers);
      walkers[c].push_back({Walker::kFetcher});
      walkers[c].push_back({Walker::kVWarp});
      for (int w = 0; w < consumers; ++w) walkers[c].push_back({Walker::kConsumer});
      for (auto& w : walkers[c]) {
        w.position = c;
        w.seen.push_back(c);
      }
      ctas[c].fetched.push_back(c);
    }
    // Tiles with work a consumer warp has finished (its next position read): the slowest one's count frees buffers.
    auto consumers_done = [&](int c) {
      int done = 1 << 30;
      for (const auto& w : walkers[c]) {
        if (w.kind == Walker::kConsumer) done = std::min(done, w.work_index);
      }
      return done;
    };
    // One step of walker w of CTA c; false: it waits.
    auto step = [&](int c, Walker& w) {
      Cta& cta = ctas[c];
      if (w.position >= num_tiles) return false;
      const bool work = has_work[w.position];
      const int k = w.work_index;  // this tile's index among the tiles with work, if it has work
      if (w.kind == Walker::kFetcher) {
        if (work && cta.loaded == k) {  // load Q/K first: Q buffer k % 2 free once tile k - 2 is done
          if (consumers_done(c) < k - 1) return false;
          ++cta.loaded;
          return true;
        }
        if (!w.ticket_drawn) {
          w.ticket = counter++;
          w.ticket_drawn = true;
          return true;
        }
        if (!cta.empty[Ring::slot_of(w.n)].passes(Ring::parity_of(w.n) ^ 1)) return false;
        const int next = Ring::position_of_ticket(w.ticket, grid, num_tiles);
        cta.slots[Ring::slot_of(w.n)] = next;
        cta.full[Ring::slot_of(w.n)].arrive();
        cta.fetched.push_back(next);
        ++w.n;
        w.ticket_drawn = false;
      } else {
        if (work) {
          if (cta.loaded <= k) return false;  // its Q (and, for the consumers, its K) not loaded yet
          if (w.kind == Walker::kVWarp && (consumers_done(c) < k - 1)) return false;  // V stage not free
        }
        if (!cta.full[Ring::slot_of(w.n)].passes(Ring::parity_of(w.n))) return false;
        const int next = cta.slots[Ring::slot_of(w.n)];
        cta.empty[Ring::slot_of(w.n)].arrive();
        ++w.n;
        w.position = next;
        w.seen.push_back(next);
        if (work) ++w.work_index;
        return true;
      }
      // The fetcher moves on to the position it published.
      if (work) ++w.work_index;
      w.position = cta.fetched.back();
      w.seen.push_back(w.position);
      return true;
    };
    while (true) {
      std::vector<std::pair<int, int>> ready;
      bool all_done = true;
      for (int c = 0; c < grid; ++c) {
        for (size_t i = 0; i < walkers[c].size(); ++i) {
          if (walkers[c][i].position < num_tiles) {
            all_done = false;
            ready.push_back({c, int(i)});
          }
        }
      }
      if (all_done) break;
      std::shuffle(ready.begin(), ready.end(), rng);
      bool moved = false;
      for (const auto& [c, i] : ready) {
        if (step(c, walkers[c][i])) {
          moved = true;
          break;
        }
      }
      ASSERT_TRUE(moved) << "trial " << trial << ": deadlock";
    }
    std::vector<int> visits(num_tiles, 0);
    for (int c = 0; c < grid; ++c) {
      const std::vector<int>& fetched = ctas[c].fetched;
      ASSERT_EQ(fetched.back(), num_tiles) << "trial " << trial;
      for (size_t i = 0; i + 1 < fetched.size(); ++i) ++visits[fetched[i]];
      for (const auto& w : walkers[c]) ASSERT_EQ(w.seen, fetched) << "trial " << trial << " cta " << c;
    }
    for (int p = 0; p < num_tiles; ++p) ASSERT_EQ(visits[p], 1) << "trial " << trial << " position " << p;
  }
}

// Tickets past the walk, and a counter nobody zeroed, end it: no position outside [0, num_tiles).
TEST(VarlenRing, TicketsOutsideTheWalkEndIt) {
  EXPECT_EQ(Ring::position_of_ticket(0, 3, 10), 3);
  EXPECT_EQ(Ring::position_of_ticket(6, 3, 10), 9);
  EXPECT_EQ(Ring::position_of_ticket(7, 3, 10), 10);
  EXPECT_EQ(Ring::position_of_ticket(-1, 3, 10), 10);
  EXPECT_EQ(Ring::position_of_ticket(INT_MIN, 3, 10), 10);
  EXPECT_EQ(Ring::position_of_ticket(INT_MAX - 5, 132, INT_MAX), INT_MAX);
  EXPECT_EQ(Ring::position_of_ticket(0, 4, 4), 4);
}

}  // namespace
}  // namespace flashjax::sm90
