import time

import pytest

from glm53.support.step_timing import median_step_ms


def test_median_leaves_out_the_first_three_calls_and_syncs_before_each():
    calls, syncs = [], []
    # the first three calls are slow (compiles, captures): they must not move the median
    sleeps = [0.2, 0.2, 0.2, 0.001, 0.002, 0.003]

    def fn(i):
        calls.append(i)
        time.sleep(sleeps[i])

    ms = median_step_ms(fn, len(sleeps), lambda: syncs.append(len(calls)))
    assert calls == list(range(6)) and syncs == list(range(6))
    assert 1.5 < ms < 60  # the median of 1, 2, 3 ms (with the first three in it: ~100 ms)


def test_too_few_iterations_is_an_error():
    with pytest.raises(ValueError, match="at least 4"):
        median_step_ms(lambda i: None, 3, lambda: None)
