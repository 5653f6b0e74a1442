"""pd_bench.rotated_passes: every prompt reaches every deployment back to back, the first one
rotating, and each pass marks the prompt at its start (so no pass hits an earlier pass's prefix)."""

from glm53.support.pd_bench import rotated_passes


def test_each_prompt_visits_every_deployment_in_rotating_order():
    got = list(rotated_passes(2, ["a", "b"], ["x", "y", "z"]))
    assert [n for n, _ in got] == ["x", "y", "z", "y", "z", "x", "z", "x", "y", "x", "y", "z"]
    assert [t for _, t in got[:3]] == ["# pass 0\na"] * 3
    assert got[-1][1] == "# pass 1\nb"
    assert len({t for _, t in got}) == 4  # distinct across passes, at the start
