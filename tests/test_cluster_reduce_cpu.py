"""The K-split exchange's arithmetic (cute_kernels.cluster_reduce): who owns which sub-tile,
where each sender's partial sums land, and what the receive buffer holds."""
import itertools

import pytest

from cute_kernels.cluster_reduce import VEC, ClusterReduce


def slot(sender: int, owner: int) -> int:
    """The sender slot ClusterReduce.exchange writes at (its rank, less one past the owner's)."""
    return sender - 1 if sender > owner else sender


@pytest.mark.parametrize("ctas, parts, rows", [(2, 8, 4), (4, 8, 4), (2, 4, 2), (4, 16, 2), (8, 8, 4)])
def test_every_partial_sum_has_one_place(ctas, parts, rows):
    red = ClusterReduce(ctas, parts, rows)
    # each sub-tile has one owner; every CTA owns the same number
    owners = [red.owner(s) for s in range(parts)]
    assert all(owners.count(r) == red.owned for r in range(ctas))
    # the senders of a sub-tile write distinct slots, and every slot of its owner is written
    for s in range(parts):
        slots = sorted(slot(r, red.owner(s)) for r in range(ctas) if r != red.owner(s))
        assert slots == list(range(ctas - 1))
    # the buffer layout is a bijection onto [0, words): no two stores overlap, nothing unwritten
    idx = {red.offset(c) for c in itertools.product(range(VEC), range(red.threads), range(rows), range(red.owned),
                                                 range(ctas - 1))}
    assert idx == set(range(red.words)) and len(idx) == len(list(itertools.product(*map(range, red.buffer_shape))))
    assert red.tx_bytes == 4 * red.words == (ctas - 1) * red.owned * rows * red.threads * VEC * 4
    # a thread's 4 columns are one aligned 16-byte store, neighbouring threads' stores adjacent
    assert red.offset((0, 1, 0, 0, 0)) - red.offset((0, 0, 0, 0, 0)) == VEC


@pytest.mark.parametrize("kwargs, match", [
    (dict(ctas=3, parts=6, rows=4), "2, 4 or 8"),
    (dict(ctas=4, parts=6, rows=4), "do not deal evenly"),
    (dict(ctas=2, parts=8, rows=4, cols=8), "one 16-byte store"),
])
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterReduce(**kwargs)
