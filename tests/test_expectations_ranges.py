"""Each known bug's range in words (``Known.range_text``, ``ranges_short``, ``ranges_table``), the boundary between
the last release known affected and the fix, and a pinned release no rule covers: the real pin table's sentences
(release numbers as ``kit/judge/pins.py`` and the module docstring of ``gradkit.judge.expectations`` document them), and
a synthetic bug put in the tables for the cases the real one lacks (nothing written to disk)."""
import dataclasses

import pytest

from gradkit.judge import expectations as ex
from gradkit.judge import pins
from gradkit.judge.pins import Pin

# ------------------------------------------------------------------ the real table


def test_a_bug_introduced_and_fixed_with_releases_between_that_cannot_run_says_both_boundaries():
    # B5: 0.15.1 exact, 0.15.2 affected; 0.18.6 affected, 0.19.0 fixed, 0.18.7 - 0.18.9 cannot run here
    assert ex.KNOWN["B5"].range_text() == (
        "B5 (deepspeed): introduced in 0.15.2 (0.15.1 without it); "
        "fixed in 0.19.0 (0.18.6 with it; 0.18.7, 0.18.8, 0.18.9 cannot run here)")


def test_a_bug_no_release_fixes_says_its_start_and_how_far_it_was_measured():
    # B3: 0.17.5 exact, 0.17.6 - 0.18.2 crash in the loop, 0.18.3 the first affected; no release fixes it
    assert ex.KNOWN["B3"].range_text() == (
        "B3 (deepspeed): introduced in 0.18.3 (0.17.5 without it; 0.17.6, 0.18.0, 0.18.1, 0.18.2 cannot run here); "
        "no release fixes it (measured up to 0.19.8)")
    assert ex.KNOWN["B9"].range_text() == (
        "B9 (deepspeed): introduced in 0.18.3 (0.18.2 without it): every update / loss_scale (before it the step is "
        "right, the logged norm x loss_scale); no release fixes it (measured up to 0.19.8)")


def test_a_bug_whose_start_is_older_than_what_runs_here_says_so_instead_of_a_start():
    assert ex.KNOWN["B6"].range_text() == (
        f"B6 (deepspeed): {pins.START_HIDDEN['B6']}; no release fixes it (measured up to 0.19.8)")
    assert ex.KNOWN["B8"].range_text() == (
        f"B8 (deepspeed): {pins.START_HIDDEN['B8']}; fixed in 0.19.8 (0.19.7 with it)")
    assert "start not pinned" not in ex.KNOWN["B6"].range_text()


def test_a_step_that_changes_inside_the_range_is_said_with_its_boundary_and_its_detail():
    # B2: introduced in 0.16.0 (sums), its step changes at 0.18.5 (0.18.3 - 0.18.4 refuse), fixed in 0.19.3
    assert ex.KNOWN["B2"].range_text() == (
        "B2 (deepspeed): introduced in 0.16.0 (0.15.4 without it): every stage sums its micro-batches (x GA); "
        "from 0.18.5 (0.18.2 before; 0.18.3, 0.18.4 cannot run here) the step changes: the earlier stage divided by "
        "GA twice, the last one right; fixed in 0.19.3 (0.19.2 with it)")


def test_only_another_recipes_boundaries_are_named_by_their_series():
    text = ex.KNOWN["HFT"].range_text()
    parts = text.split(": ", 1)[1].split("; ")
    assert parts[0] == pins.START_HIDDEN["HFT"].split("; ")[0]  # no introduced pin: the hidden start first
    tagged = [p for p in parts if p.endswith("]")]
    assert sorted(t.rsplit(" [", 1)[1][:-1] for t in tagged) == sorted(
        p.series for p in pins.PINS["HFT"] if p.series != "HFT")
    assert "[HFT]" not in text
    assert "fixed in 5.10.1 (5.9.0 with it) [HFT gas1]" in parts
    assert "fixed in 5.10.1 (5.9.0 with it)" in parts  # HFT's own fix, untagged
    assert "[B1]" not in ex.KNOWN["B1"].range_text()
    assert "from 4.47.0 (4.46.3 before) the step changes: micro-batches summed (ratio 4.0)" in \
        ex.KNOWN["B1"].range_text().split("; ")


def test_a_known_bug_reads_its_pins_as_a_property_and_is_frozen():
    assert ex.KNOWN["B5"].pins == pins.PINS["B5"]
    assert ex.KNOWN["B6"].pins == ()
    k = ex.Known("BX", "pkg", "report", affected_from=None, fixed_in=None, last_affected=None, newest_pinned="1.0.0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.fixed_in = "0.9.0"  # the table is shared by every notebook: no caller may change it
    assert hash(k) == hash(dataclasses.replace(k))


def test_the_short_rows_say_each_bugs_own_start_and_end_and_how_many_changes_lie_between():
    rows = {r.split(" | ")[0].strip("| "): r for r in ex.ranges_short().splitlines()[2:]}
    assert list(rows) == list(ex.KNOWN)
    assert rows["B5"] == "| B5 | deepspeed | 0.15.2 (0.15.1 without it) | 0.19.0 (0.18.6 with it) | - | - |"
    assert rows["B3"] == "| B3 | deepspeed | 0.18.3 (0.17.5 without it) | no release fixes it | - | - |"
    assert rows["B6"] == (f"| B6 | deepspeed | {pins.START_SHORT['B6']} | no release fixes it | - | "
                          "[B6](docs/reports/B6/report.md) |")  # docs/reports/B6: the kit's fix, verified
    assert rows["B2"] == "| B2 | deepspeed | 0.16.0 (0.15.4 without it) | 0.19.3 (0.19.2 with it) | 1 | - |"
    # B1: seven pins, the start and the fix among them: five changes of the step between
    assert rows["B1"] == "| B1 | transformers | 4.46.2 (4.46.1 without it) | 5.10.1 (5.9.0 with it) | 5 | - |"
    hft_own = [p for p in pins.PINS["HFT"] if p.series == "HFT"]
    assert rows["HFT"].endswith(f"| {len(hft_own) - 1} | - |")  # its own fix left out, the other recipes' not counted


def test_the_table_rows_say_each_bugs_whole_range_and_the_commands_that_found_it():
    rows = {r.split(" | ")[0].strip("| "): r for r in ex.ranges_table().splitlines()[2:]}
    assert list(rows) == list(ex.KNOWN)
    for bug, k in ex.KNOWN.items():
        assert rows[bug].startswith(f"| {bug} | {k.package} | ")
        assert f" | {k.range_text()[len(f'{bug} ({k.package}): '):]} | " in rows[bug]
    assert rows["B2"] == (
        "| B2 | deepspeed | introduced in 0.16.0 (0.15.4 without it): every stage sums its micro-batches (x GA); "
        "from 0.18.5 (0.18.2 before; 0.18.3, 0.18.4 cannot run here) the step changes: the earlier stage divided by "
        "GA twice, the last one right; fixed in 0.19.3 (0.19.2 with it) | `gradkit bisect --known B2 --keep` |")
    assert rows["B6"].endswith(" | - |")  # no pin: found by no bisect
    assert rows["HFT"].endswith(" | `gradkit bisect --known 'HFT avg_tokens_on' --keep`; "
                                "`gradkit bisect --known 'HFT gas1' --keep`; `gradkit bisect --known HFT --keep` |")


def test_the_release_between_the_last_known_affected_and_the_fix_is_not_pinned_but_the_last_affected_is():
    # B5: 0.18.9 read affected in its source (last_affected), 0.19.0 the fix
    assert ex.expected("B5", {"deepspeed": "0.18.9"}) == "affected"
    assert ex.expected("B5", {"deepspeed": "0.19.0"}) == "not-affected"
    k = ex.Known("BX", "pkg", "r", affected_from="1.0.0", fixed_in="1.5.0", last_affected="1.3.0",
                 newest_pinned="2.0.0")
    assert [k.expected_for_release(v) for v in ("0.9.0", "1.0.0", "1.3.0", "1.3.1", "1.4.0", "1.5.0", "2.0.0", "2.0.1")] \
        == [None, "affected", "affected", None, None, "not-affected", "not-affected", None]


def test_the_newest_pinned_release_with_no_rule_for_the_case_is_not_pinned_rather_than_newer():
    # HFT's sum_not_mean is pinned from GA 2 only (at GA 1 nothing is summed); 5.24.0 is HFT's newest pinned release
    assert ex.KNOWN["HFT"].newest_pinned == "5.24.0"
    word, text = ex.judge_release("HFT", {"transformers": "5.24.0"}, "affected", case="sum_not_mean", ga=1)
    assert (word, text) == ("finding", "HFT on transformers 5.24.0, case sum_not_mean, ga 1: affected "
                                       "(this release is not pinned in the table)")
    word, text = ex.judge_release("HFT", {"transformers": "5.24.1"}, "affected", case="sum_not_mean", ga=1)
    assert word == "finding" and "(newer than the table's 5.24.0) is still affected" in text


# ------------------------------------------------------------------ a synthetic bug, for what the real table lacks

def _pin(what, before, after, series="BX", between=()):
    return Pin(what, before, after, series, f"gradkit bisect --known {series} --keep", "f()", between)


def _known(**kw):
    base = dict(affected_from=None, fixed_in=None, last_affected=None, newest_pinned="3.0.0")
    return ex.Known("BX", "pkg", "report", **{**base, **kw})


@pytest.fixture
def table(monkeypatch):
    """Put bug BX into the pin table with the pins given (restored after the test)."""
    def put(*bx_pins, hidden=None):
        monkeypatch.setitem(pins.PINS, "BX", tuple(bx_pins))
        if hidden is not None:
            monkeypatch.setitem(pins.START_HIDDEN, "BX", hidden)
    return put


def test_a_start_no_bisect_pinned_is_said_from_the_table_or_as_not_pinned(table):
    table(_pin("fixed", "1.9.0", "2.0.0"))
    assert _known(affected_from="1.2.0", fixed_in="2.0.0").range_text() == (
        "BX (pkg): affected from 1.2.0 (not pinned by a bisect); fixed in 2.0.0 (1.9.0 with it)")
    assert _known(fixed_in="2.0.0").range_text() == "BX (pkg): start not pinned; fixed in 2.0.0 (1.9.0 with it)"
    table(_pin("fixed", "1.9.0", "2.0.0"), hidden="older than 1.0.0")
    assert _known(affected_from="1.2.0", fixed_in="2.0.0").range_text() == (
        "BX (pkg): older than 1.0.0; fixed in 2.0.0 (1.9.0 with it)")


def test_a_fix_no_bisect_pinned_is_said_from_the_table(table):
    table(_pin("introduced", "1.1.0", "1.2.0"))
    assert _known(fixed_in="2.0.0").range_text() == (
        "BX (pkg): introduced in 1.2.0 (1.1.0 without it); fixed in 2.0.0 (not pinned by a bisect)")
    table()
    assert _known(fixed_in="2.0.0").range_text() == "BX (pkg): start not pinned; fixed in 2.0.0 (not pinned by a bisect)"
    assert _known().range_text() == "BX (pkg): start not pinned; no release fixes it (measured up to 3.0.0)"


def test_each_kind_of_boundary_with_its_detail_its_gap_and_another_recipes_name(table):
    table(_pin("introduced: x2", "1.1.0", "1.2.0"),
          _pin("the step changes: x3", "1.3.0", "1.6.0", between=("1.4.0", "1.5.0")),
          _pin("the step changes: x4", "1.6.0", "1.7.0", series="BX other"),
          _pin("introduced", "1.0.0", "1.1.0", series="BX other", between=("1.0.1",)),
          _pin("fixed: at last", "1.9.0", "2.0.0", series="BX other"),
          _pin("fixed", "1.9.0", "2.0.0", between=("1.9.1",)))
    assert _known(fixed_in="2.0.0").range_text() == (
        "BX (pkg): introduced in 1.2.0 (1.1.0 without it): x2; "
        "from 1.6.0 (1.3.0 before; 1.4.0, 1.5.0 cannot run here) the step changes: x3; "
        "from 1.7.0 (1.6.0 before) the step changes: x4 [BX other]; "
        "introduced in 1.1.0 (1.0.0 without it; 1.0.1 cannot run here) [BX other]; "
        "fixed in 2.0.0 (1.9.0 with it): at last [BX other]; "
        "fixed in 2.0.0 (1.9.0 with it; 1.9.1 cannot run here)")


def test_the_short_and_the_long_table_of_a_synthetic_table(table, monkeypatch):
    table(_pin("the step changes: x3", "1.0.0", "1.1.0", series="BX other"),
          _pin("introduced", "1.1.0", "1.2.0"), _pin("the step changes: x2", "1.3.0", "1.4.0"),
          _pin("the step changes: x5", "1.4.0", "1.5.0"), _pin("fixed", "1.9.0", "2.0.0"))
    monkeypatch.setitem(pins.PINS, "BY", ())
    bx, by = _known(fixed_in="2.0.0"), dataclasses.replace(_known(), bug="BY", package="other")
    monkeypatch.setattr(ex, "KNOWN", {"BX": bx, "BY": by})
    assert ex.ranges_short().splitlines() == [
        "| bug | package | starts | ends | other changes of the step | a fix, verified by the kit |",
        "|---|---|---|---|---|---|",
        "| BX | pkg | 1.2.0 (1.1.0 without it) | 2.0.0 (1.9.0 with it) | 2 | - |",
        "| BY | other | not pinned | no release fixes it | - | - |"]
    assert ex.ranges_table().splitlines() == [
        "| bug | package | range (each boundary: the last release before, the first after, both measured) | found by |",
        "|---|---|---|---|",
        "| BX | pkg | from 1.1.0 (1.0.0 before) the step changes: x3 [BX other]; introduced in 1.2.0 (1.1.0 without it); "
        "from 1.4.0 (1.3.0 before) the step changes: x2; from 1.5.0 (1.4.0 before) the step changes: x5; "
        "fixed in 2.0.0 (1.9.0 with it) | `gradkit bisect --known BX --keep`; `gradkit bisect --known BX other --keep` |",
        "| BY | other | start not pinned; no release fixes it (measured up to 3.0.0) | - |"]
