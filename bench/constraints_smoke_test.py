"""//bench:constraints end to end at a small size: every method runs, the JSON line parses, and
the bench's own correctness checks hold (paved's allowed sets equal xgrammar's on every row,
every difference from outlines-core is a documented one, `apply`, `fill_bitmask` and the
gathered `fill_unique_bitmask` agree). No timing is asserted: numbers are only checked to exist.
"""

import itertools
import json

from bench import constraints as bench  # Bazel makes bench/ a package in runfiles


def test_quick_run_reports_every_method_and_passes_its_checks(capsys):
    assert bench.main(["--quick", "--json", "--vocab-sizes", "4096", "--batch-sizes", "1,8,32"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" not in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["paved_available"] is True
    assert summary["check_differences_vs_xgrammar"] == 0
    assert summary["check_unexplained_vs_outlines_core"] == 0
    cell = summary["results"]["synthetic 4k"]
    for method in bench.METHODS:
        assert set(cell["us_per_step"][method]) == {"1", "8", "32"}, method
    unique = cell["unique_rows"]
    assert set(unique) == {"1", "8", "32"}
    assert all(1 <= n <= int(b) for b, n in unique.items())
    # No B=64 / V=128k cell in this grid: the headline keys are present and null.
    assert summary["ratio_vs_python_b64_v128k"] is None
    assert summary["ratio_unique_vs_python_b64_v128k"] is None


def test_predecessor_effect_mode_times_every_call_in_every_condition(capsys):
    assert bench.main(["--predecessor-effect", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {
        "paved fill_bitmask",
        "paved fill_unique_bitmask",
        "numpy write of the bitmask bytes (1 thread)",
    }
    for cells in out.values():
        assert set(cells) == {"warm", "after a 32 MiB write", "after xgrammar"}
        assert all(us > 0 for us in cells.values())


def test_fill_breakdown_mode_reports_every_variant_and_its_traffic(capsys):
    assert bench.main(["--fill-breakdown", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = ("paved, bench rows", "paved, one mask, 64 states", "paved, no state")
    assert set(out) == {"numpy_write_us", "numpy write", *rows}
    for name in rows:
        assert out[name]["us"] > 0 and out[name]["ratio_vs_numpy_write"] > 0
    # The bench's rows sit in several automaton states; the other two variants read one mask.
    assert out["paved, bench rows"]["distinct_masks"] > 1
    assert (
        out["paved, one mask, 64 states"]["distinct_masks"] == out["paved, no state"]["distinct_masks"] == 1
    )
    assert out["paved, bench rows"]["traffic_ratio"] == (64 + out["paved, bench rows"]["distinct_masks"]) / 64


def test_rounds_keep_paved_methods_apart():
    rng = bench.random.Random(1)
    names = ["python", "outlines-core", "xgrammar", "bitmask write", "paved", "paved unique", "paved apply"]
    apart = {"paved", "paved unique", "paved apply"}
    last = None
    for _ in range(200):
        order = bench._spread_order(names, apart, last, rng)
        assert sorted(order) == sorted(names)
        calls = [last, *order] if last else order
        assert not any(a in apart and b in apart for a, b in itertools.pairwise(calls))
        last = order[-1]
