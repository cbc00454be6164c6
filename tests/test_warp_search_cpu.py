"""cute_kernels.scheduler.warp_search's rounds, emulated lane by lane on the host: the same
positions, ballots and narrowing as the device code, against bisect."""
import bisect
import random

import pytest

from cute_kernels.scheduler import SEARCH_LOADS, SEARCH_WIDTH


def emulated_search(starts, value, lo, hi):
    """warp_search with 32 lanes of SEARCH_LOADS loads each a round; -> (position, rounds)."""
    rounds = 0
    while hi - lo > 1:
        step = (hi - lo + SEARCH_WIDTH - 1) // SEARCH_WIDTH
        seen = 0
        for e in range(SEARCH_LOADS):
            ballot = [(j := lo + (lane * SEARCH_LOADS + e) * step) < hi and starts[j] <= value for lane in range(32)]
            seen += sum(ballot)
        lo = lo + (seen - 1) * step
        hi = min(lo + step, hi)
        rounds += 1
    return lo, rounds


@pytest.mark.parametrize("groups", [1, 2, 31, 33, 64, 65, 1000, 4096, 4097, 57344])
def test_warp_search_matches_bisect(groups):
    rng = random.Random(groups)
    # Tile starts as the work list writes them: non-decreasing, empty groups repeat a value.
    starts = [0]
    for _ in range(groups):
        starts.append(starts[-1] + rng.choice([0, 0, 1, 1, 2, 5]))
    total = starts[-1]
    for value in sorted({0, total, max(total - 1, 0), *(rng.randrange(total + 1) for _ in range(200))}):
        want = bisect.bisect_right(starts[:groups], value) - 1
        got, rounds = emulated_search(starts, value, 0, groups)
        assert got == want, (groups, value)
        # One round up to SEARCH_WIDTH entries, a second up to its square.
        width, need = 1, 0
        while width < groups:
            width *= SEARCH_WIDTH
            need += 1
        assert rounds <= need
