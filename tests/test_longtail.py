"""``corun bench longtail``'s job (benchmarks/longtail_job.py): long-tailed lengths, and
each row cut back to what the recipe keeps. The suite itself runs at the test grid
from the wheel (tests/test_wheel.py)."""

from __future__ import annotations

from benchmarks.longtail_job import TAIL_CAP, cut, tail_lengths
from corun.contract.engine import Generation, Sampling


def test_lengths_are_long_tailed() -> None:
    lengths = tail_lengths(10_000, 8, seed=0)
    assert lengths == tail_lengths(10_000, 8, seed=0)  # seeded: the same run, the same tail
    assert min(lengths) == 8 and max(lengths) == 8 * TAIL_CAP
    short = sum(n <= 16 for n in lengths) / len(lengths)
    long = sum(n >= 80 for n in lengths) / len(lengths)
    assert short > 0.5 and 0.02 < long < 0.15, (short, long)


def test_a_row_is_cut_back_to_the_recipes_reply() -> None:
    sampling = Sampling(max_tokens=4, stop_ids=(2,))
    long = Generation([5, 2, 7, 7, 7, 7], [-0.1] * 6, [0, 0, 1, 1, 1, 1], "length")
    assert cut(long, sampling) == Generation([5, 2], [-0.1] * 2, [0, 0], "stop")
    unstopped = Generation([5, 6, 7, 8, 9], [-0.2] * 5, [3, 3, 3, 4, 4], "length")
    assert cut(unstopped, sampling) == Generation([5, 6, 7, 8], [-0.2] * 4, [3, 3, 3, 4],
                                                   "length")  # fmt: skip
