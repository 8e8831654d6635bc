"""A short soak (the long one: `freescale-bench soak --ops 10000`): 4 ranks x 300 random ops of 11
dtypes, 0 B ... 256 KiB per peer, priorities -10 ... 200, async ops waited on out of order, strided
inputs; every byte checked."""

import pytest

from freescale_comm.bench import soak


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_short_soak_moves_every_byte_right():
    rows = soak.run(4, 300, seed=7, max_bytes=256 << 10, window=40, timeout_s=550)
    assert [r["wrong_bytes"] for r in rows] == [0, 0, 0, 0], rows
    assert all(r["bytes_received"] > 0 for r in rows), rows
