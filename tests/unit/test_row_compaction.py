"""`common.compacted`: when rows leave a batch, the fewest rows move, each into a hole from beyond the new size."""

import pytest

from umakit.backends.common import compacted, kept


@pytest.mark.parametrize("rows, drop, order", [
    (5, [1], [0, 4, 2, 3]),  # the last row fills the hole; the others stay put
    (5, [0, 4], [3, 1, 2]),
    (6, [1, 2], [0, 5, 4, 3]),
    (3, [2], [0, 1]),  # the last row left: nothing moves
    (4, [0, 1, 2, 3], []),
])
def test_the_fewest_rows_move(rows, drop, order):
    got = compacted(kept(list(range(rows)), drop))
    assert got == order
    assert sorted(got) == [i for i in range(rows) if i not in drop]  # every row that stays, once
    assert all(old >= len(got) for slot, old in enumerate(got) if old != slot)  # movers come from beyond the end
