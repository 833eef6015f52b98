"""The host-side launch helpers agree with Triton's own (which the kernels' grids used before)."""

import random

import triton

from ssmshard.kernels.launch_math import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    rng = random.Random()
    values = list(range(1, 300)) + [rng.randrange(1, 1 << 40) for _ in range(300)]
    for a in values:
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, rng.randrange(1, 1 << 20)):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert cdiv(0, 7) == 0
