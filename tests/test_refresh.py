"""The upstream table kept true: the known bugs' recipes, the release history and the table's refresh
(``scripts/refresh_table``), with the measure, the index and the install replaced (the measurements themselves are
``gradkit bisect``'s, tested in test_bisect.py on real worlds)."""
import json
import re

import pytest

from gradkit import config as kconfig
from gradkit.commands import refresh
from gradkit.commands.bisect import known, listing, result, search
from gradkit.judge import expectations, history, oracle, pins
from gradkit.judge.pins import Pin
from gradkit.notebooks import bisect_known
from gradkit.stacks import prefetch as kprefetch

GOOD = {"verdict": oracle.NOT_AFFECTED, "step": None, "ratios": [1.0], "dtype": "fp32"}
SKIP = {"verdict": oracle.CANNOT_RUN, "step": None, "ratios": [], "reason": "does not install here"}


def bad(step="x", ratio=0.4):
    return {"verdict": oracle.AFFECTED, "step": step, "ratios": [ratio], "dtype": "fp32"}


# ---------------------------------------------------------------------------------------------- the recipes

def test_every_known_bug_has_a_recipe_and_every_recipe_measures_a_known_bug_on_a_package_its_probe_names():
    assert {r.bug for r in known.RECIPES.values()} == set(expectations.KNOWN) - {"FSDP2"}  # torch: one release here
    for r in known.RECIPES.values():
        assert r.bug in expectations.KNOWN and bool(r.probe) != bool(r.config), r
        probe = known.probe_of(r)
        assert r.axis in probe.packages and all(p in probe.packages for p, _ in r.fixed), r
        kconfig.check_version(r.oldest)
        assert r.older, r
        if r.config:
            known.resolved(r)  # a config the check's probe accepts


def test_a_recipes_stack_holds_its_release_and_what_it_keeps_fixed(monkeypatch):
    monkeypatch.setattr(listing.versions, "installed_version", lambda p: "0.19.8")
    r = known.RECIPES["B1 on DeepSpeed"]
    assert known.stack_of(r, "0.18.6") == {"transformers": "5.3.0", "deepspeed": "0.18.6"}
    assert known.stack_of(r, "0.19.8") == {"transformers": "5.3.0"}  # the installed DeepSpeed needs no overlay
    assert known.needs(r, ["0.18.6", kconfig.INSTALLED]) == [
        (known.probe_of(r), {"transformers": "5.3.0", "deepspeed": "0.18.6"}), (known.probe_of(r), {"transformers": "5.3.0"})]
    assert known.command(known.RECIPES["B5"]) == "gradkit bisect --known 'B5' --from 0.14.4"
    assert known.command(r, "0.18.0", "0.19.0") == "gradkit bisect --known 'B1 on DeepSpeed' --from 0.18.0 --to 0.19.0"


def test_a_recipe_measures_through_the_checks_probe_or_its_own_probe_with_what_it_holds(monkeypatch):
    made = []
    monkeypatch.setattr(result, "measure_with", lambda cfg, loop, w, d, t, s, model, fixed: made.append(
        ("config", loop, w, model, fixed, cfg["zero_optimization"]["stage"])))
    monkeypatch.setattr(result, "probe_measure", lambda p, kw, case, axis, fixed: made.append(
        ("probe", p.id, kw, case, axis, fixed)))
    known.measure(known.RECIPES["B7"], world_size=2, device="cpu", timeout_s=9)
    assert made[-1] == ("config", "engine", 2, "conditional", {}, 2)
    known.measure(known.RECIPES["B1 on DeepSpeed"], timeout_s=9)
    assert made[-1] == ("probe", "B1", {**known.RECIPES["B1 on DeepSpeed"].plan, "device": "cpu", "timeout_s": 9},
                        "trainer", "deepspeed", {"transformers": "5.3.0"})
    known.measure(known.RECIPES["HFT"], world_size=2, timeout_s=9)  # no plan: the probe's quick plan
    from gradkit import probes
    assert made[-1][2] == {**probes.get("HFT").quick_plan(2), "device": "cpu", "timeout_s": 9}


# ---------------------------------------------------------------------------------------------- the history

def test_the_history_keeps_one_result_per_release_and_says_what_moved(tmp_path):
    h = history.load(tmp_path / "none.json")
    assert h == {"series": {}}
    moved = history.merge(h, "B5", "B5", "deepspeed", {}, {"0.19.0": GOOD, "0.15.2": bad("first and last", 0.4123456789)},
                          "gradkit bisect --known 'B5'", "2026-11-26", result.same)
    assert moved == []
    s = h["series"]["B5"]
    assert s["bug"] == "B5" and s["axis"] == "deepspeed" and s["with"] == {}
    assert s["releases"]["0.15.2"] == {"verdict": oracle.AFFECTED, "step": "first and last", "ratios": [0.412346],
                                       "dtype": "fp32", "by": "gradkit bisect --known 'B5'", "on": "2026-11-26"}
    # measured again the same: nothing moved; otherwise one sentence with both results and where the old came from
    assert history.merge(h, "B5", "B5", "deepspeed", {}, {"0.19.0": {**GOOD, "ratios": [1.00001]}}, "again",
                         "2026-11-27", result.same) == []
    moved = history.merge(h, "B5", "B5", "deepspeed", {}, {"0.15.2": GOOD}, "refresh", "2026-12-01", result.same)
    assert moved == ["B5 on deepspeed 0.15.2: was affected 'first and last' ratio 0.412 (gradkit bisect --known 'B5', "
                     "2026-11-26), now not-affected ratio 1.000"]
    # a release that cannot run now keeps what it measured before
    assert history.merge(h, "B5", "B5", "deepspeed", {}, {"0.15.2": SKIP, "0.14.0": SKIP}, "r", "d", result.same) == []
    assert s["releases"]["0.15.2"]["verdict"] == oracle.NOT_AFFECTED
    assert s["releases"]["0.14.0"]["reason"] == "does not install here"
    assert [r for r, _ in history.releases(s)] == ["0.14.0", "0.15.2", "0.19.0"]
    path = tmp_path / "h.json"
    history.save(h, path)
    assert list(json.loads(path.read_text())["series"]["B5"]["releases"]) == ["0.14.0", "0.15.2", "0.19.0"]
    assert history.load(path) == json.loads(path.read_text())
    history.merge(h, "B3 opt-out", "B3", "deepspeed", {}, {"0.19.4": GOOD}, "r", "d", result.same)
    assert list(history.series(h, "B3")) == ["B3 opt-out"] and list(history.series(h)) == ["B3 opt-out", "B5"]


def test_the_history_is_written_as_committed_and_keeps_each_number_to_six_places_and_a_reason_to_200_characters(
        tmp_path):
    committed = history.PATH.read_text()
    history.save(history.load(), tmp_path / "again.json")  # a save of what it read changes nothing (a diff shows
    assert (tmp_path / "again.json").read_text() == committed  # only what moved)
    kept = history.compact({"verdict": oracle.AFFECTED, "ratios": [0.12345678, "skipped"], "cosine": 0.987654321,
                            "misplaced_weight": 0.1234564, "reason": "x" * 300, "metrics": {"big": 1}}, "by", "on")
    assert kept == {"verdict": oracle.AFFECTED, "ratios": [0.123457, "skipped"], "cosine": 0.987654,
                    "misplaced_weight": 0.123456, "reason": "x" * 200, "by": "by", "on": "on"}


def test_the_committed_history_holds_both_sides_of_every_pin_and_agrees_with_the_table(monkeypatch):
    h = history.load()
    assert bisect_known.history_violations(h) == []
    for b, k in expectations.KNOWN.items():  # no range left open that a release installable here could close
        kinds = {p.what.split(":")[0] for p in k.pins}
        assert "introduced" in kinds or b in pins.START_HIDDEN, f"{b}: its start is neither pinned nor said hidden"
        assert k.fixed_in is None or "fixed" in kinds, f"{b}: fixed in {k.fixed_in}, but no pin says where"
        assert "not pinned" not in k.range_text(), k.range_text()
    # each kind of disagreement is found: a pin with one side missing, one whose sides measure the same, a release
    # said not to run that ran, a pinned release measured otherwise than the table says
    monkeypatch.setitem(pins.PINS, "B5", (PIN, Pin("fixed", "0.18.9", "0.19.0", "B5", "c", "f", between=("0.18.95",))))
    fake = {"series": {"B5": {"bug": "B5", "axis": "deepspeed", "with": {}, "releases": {
        "0.18.9": bad(), "0.19.0": GOOD, "0.18.95": GOOD, "0.16.0": GOOD}}}}
    found = bisect_known.history_violations(fake)
    assert "B5: 0.18.95 lies between the pin's releases as one that cannot run, but it ran" in found
    assert "B5 on 0.16.0: the history holds not-affected, the table says affected" in found
    fake["series"]["B5"]["releases"]["0.19.0"] = bad()
    assert "B5: the pin 0.18.9 -> 0.19.0 is not a measured change: affected, affected" in \
        bisect_known.history_violations(fake)
    del fake["series"]["B5"]["releases"]["0.18.9"]
    assert "B5: the pin 0.18.9 -> 0.19.0 has no measurement of both in series 'B5'" in \
        bisect_known.history_violations(fake)


# ---------------------------------------------------------------------------------------------- the refresh

PIN = Pin("fixed", "0.18.9", "0.19.0", "B5", "gradkit bisect --known 'B5'", "copy_gradients_to_cpu")


@pytest.fixture
def table(monkeypatch):
    """B5's table with one pin and newest_pinned 0.19.0; the index as given by each test."""
    k = expectations.KNOWN["B5"]
    monkeypatch.setitem(expectations.KNOWN, "B5", expectations.Known(
        "B5", "deepspeed", k.report, affected_from="0.15.2", fixed_in="0.19.0", last_affected=None,
        newest_pinned="0.19.0"))
    monkeypatch.setitem(pins.PINS, "B5", (PIN,))
    return known.RECIPES["B5"]


def test_a_refresh_measures_both_sides_of_each_pin_the_newest_pinned_and_every_newer_release(table):
    index = ["0.14.0", "0.14.4", "0.18.9", "0.19.0", "0.19.1", "0.20.0"]
    assert refresh.to_measure(table, index, False) == ["0.18.9", "0.19.0", "0.19.1", "0.20.0"]
    assert refresh.to_measure(table, index, True) == ["0.14.4", "0.18.9", "0.19.0", "0.19.1", "0.20.0"]
    assert refresh.to_measure(table, ["0.18.9", "0.19.0"], False) == ["0.18.9", "0.19.0"]  # nothing newer
    assert refresh.to_measure(known.RECIPES["B1 on DeepSpeed"], index, False) == []  # not the table's package: pins only


def test_a_pin_holds_where_its_two_releases_still_differ_and_says_why_otherwise(table):
    [c] = refresh.check_pins(table, {"0.18.9": bad(), "0.19.0": GOOD})
    assert c["holds"] is True and c["why"] == "verdict affected -> not-affected"
    [c] = refresh.check_pins(table, {"0.18.9": GOOD, "0.19.0": GOOD})
    assert c["holds"] is False and c["why"] == "0.18.9 and 0.19.0 now measure the same: not-affected"
    [c] = refresh.check_pins(table, {"0.18.9": SKIP, "0.19.0": GOOD})
    assert c["holds"] is None and c["why"] == "not measured now: 0.18.9 cannot-run; 0.19.0 not-affected"
    [c] = refresh.check_pins(table, {"0.19.0": GOOD})
    assert c["holds"] is None and "0.18.9 not run" in c["why"]


def test_a_pin_between_two_affected_releases_holds_by_its_measured_step_not_by_its_verdicts():
    """A pin says the *measurement* changes between its releases (gradkit.judge.pins), not only the verdict: B1's
    5.5.3 -> 5.5.4 is affected on both sides, the step's ratio 0.23 -> 0.91. Measured as the history holds them, it
    holds; measured with both sides the same step, it no longer does, whatever the verdicts say; and a ratio that
    moves by less than the dtype's tolerance is the same measurement."""
    (pin,) = [p for p in pins.PINS["B1"] if (p.before, p.after) == ("5.5.3", "5.5.4")]
    recipe = known.RECIPES[pin.series]
    s = history.load()["series"][pin.series]["releases"]
    before, after = s[pin.before], s[pin.after]
    assert before["verdict"] == after["verdict"] == oracle.AFFECTED  # the case this test is about

    def holds(a, b):
        return {(c["pin"].before, c["pin"].after): c for c in refresh.check_pins(recipe, {pin.before: a, pin.after: b})}[
            (pin.before, pin.after)]

    c = holds(before, after)
    assert c["holds"] is True and "ratio of step 1 0.227 -> 0.908" in c["why"], c
    c = holds(before, dict(before))
    assert c["holds"] is False and c["why"] == "5.5.3 and 5.5.4 now measure the same: affected", c
    c = holds(after, {**after, "ratios": [r * (1 + 1e-7) for r in after["ratios"]]})  # rounding, not a change
    assert c["holds"] is False, c
    c = holds(before, {**before, "step": "each micro-batch x2"})  # the same ratios, another named step
    assert c["holds"] is True and "step" in c["why"], c
    # the committed history's check reads it the same way: two affected sides that differ are a measured change,
    # two the same are not
    hist = history.load()
    hist["series"][pin.series]["releases"][pin.after] = dict(before)
    assert "B1: the pin 5.5.3 -> 5.5.4 is not a measured change: affected, affected" in \
        bisect_known.history_violations(hist)
    hist["series"][pin.series]["releases"][pin.after] = after
    assert not [v for v in bisect_known.history_violations(hist) if v.startswith("B1: the pin 5.5.3 -> 5.5.4")]


def test_the_newest_release_the_table_vouches_for_is_measured_though_no_pin_names_it(table, monkeypatch):
    """The table's newest pinned release (``Known.newest_pinned``) is the anchor every newer release is compared with:
    measured even where no pin has it on a side (the mutation run of refresh.py found this held by no test)."""
    k = expectations.KNOWN["B5"]
    monkeypatch.setitem(expectations.KNOWN, "B5", expectations.Known(
        "B5", "deepspeed", k.report, affected_from="0.15.2", fixed_in="0.19.0", last_affected=None,
        newest_pinned="0.19.1"))
    index = ["0.18.9", "0.19.0", "0.19.1", "0.19.2", "0.20.0"]
    assert refresh.to_measure(table, index, False) == index
    assert refresh.to_measure(table, ["0.18.9", "0.19.0", "0.19.2"], False) == ["0.18.9", "0.19.0", "0.19.2"]


def test_what_moved_names_a_change_no_pin_has_and_never_a_pins_own():
    """A change the refresh found is news only where no pin sits on exactly its two releases: one on a pin's two
    releases is that pin measured again; one that shares only a pin's newer release is another change."""
    pin = Pin("fixed", "0.18.9", "0.19.0", "B5", "c", "f")

    def change(before, after):
        return {"before": before, "after": after, "between": (), "from": bad(), "to": GOOD}

    others = [change("0.18.6", "0.19.0"), change("0.18.9", "0.19.1")]
    done = {"recipe": known.RECIPES["B5"], "pins": [{"pin": pin, "holds": True, "why": ""}], "new": [],
            "anchor": None, "measured": {}, "changes": [change("0.18.9", "0.19.0"), *others]}
    assert refresh.moved(done) == [f"B5: {search.describe(c)}" for c in others]


def test_ranges_only_writes_the_ranges_and_nothing_else_runs(monkeypatch, capsys):
    monkeypatch.setattr(refresh, "write_ranges", lambda: ["README.md", "docs/bugs.md"])
    monkeypatch.setattr(refresh, "refresh_one", lambda *a, **k: pytest.fail("--ranges-only measured a recipe"))
    assert refresh.main(["--ranges-only"]) == 0
    assert capsys.readouterr().out.strip() == "pinned ranges written into README.md, docs/bugs.md"
    monkeypatch.setattr(refresh, "write_ranges", lambda: [])
    assert refresh.main(["--ranges-only"]) == 0
    assert "no page (no RANGES block found)" in capsys.readouterr().out


def test_a_new_release_is_compared_with_the_newest_pinned_one_and_a_different_one_is_bisected_with_its_diff(
        table, monkeypatch):
    index = ["0.18.9", "0.19.0", "0.19.1", "0.19.2", "0.20.0"]
    results = {"0.18.9": bad(), "0.19.0": GOOD, "0.19.1": GOOD, "0.19.2": bad("y"), "0.20.0": bad("y")}
    made = []
    monkeypatch.setattr(known, "measure", lambda r, **kw: lambda rel: made.append(rel) or {**results[rel],
                                                                                          "release": rel})
    monkeypatch.setattr(refresh.diff, "diff", lambda b, a, opt, package: {"before": b, "after": a, "files": [],
                                                                          "commits": (None, None)})
    done = refresh.refresh_one(table, index, False, "cpu", 60)
    assert [c["holds"] for c in done["pins"]] == [True]
    assert done["anchor"] == "0.19.0"
    assert [(n["release"], n["same"]) for n in done["new"]] == [("0.19.1", True), ("0.19.2", False), ("0.20.0", False)]
    assert [(c["before"], c["after"]) for c in done["changes"]] == [("0.19.1", "0.19.2")]  # once, between the two
    assert sorted(made) == sorted(index)  # each release measured once
    words = refresh.moved(done)
    assert words[0].startswith("B5: 0.19.2 (newer than the table) measures otherwise than 0.19.0: verdict not-affected ->")
    assert words[1].startswith("B5: 0.20.0 (newer than the table) measures otherwise than 0.19.0")
    assert words[2].startswith("B5: 0.19.1 -> 0.19.2: last good 0.19.1, first bad 0.19.2") and len(words) == 3
    text = refresh.page([done], words, "2026-11-26", 12.0, "the package index")
    assert "| fixed | 0.18.9 | 0.19.0 | yes | verdict affected -> not-affected | `gradkit bisect --known 'B5'` " \
           "(copy_gradients_to_cpu) |" in text
    assert "- 0.20.0: affected: **another result**" in text and "- change: 0.19.1 -> 0.19.2" in text
    # the same release as the table's newest: as the table says, and nothing moved
    results.update({"0.19.2": GOOD, "0.20.0": GOOD})
    made.clear()
    done = refresh.refresh_one(table, index, False, "cpu", 60)
    assert refresh.moved(done) == [] and done["new"][0]["same"] is True and done["changes"] == []
    assert "- 0.20.0: not-affected: as the table says" in refresh.page([done], [], "d", 1.0, "idx")
    assert "Nothing: every pin holds" in refresh.page([done], [], "d", 1.0, "idx")
    news, anchor = refresh.new_releases(table, {"0.19.0": GOOD, "0.20.0": GOOD}, ["0.19.0", "0.19.1", "0.20.0"])
    assert anchor == "0.19.0" and [n["release"] for n in news] == ["0.20.0"]  # one the search passed by: not said
    results["0.20.0"] = SKIP  # a new release that cannot run here is said with its reason, not compared
    done = refresh.refresh_one(table, index, False, "cpu", 60)
    assert done["new"][-1]["same"] is None and refresh.moved(done) == []
    assert "- 0.20.0: cannot-run (does not install here): not compared" in refresh.page([done], [], "d", 1.0, "idx")


def test_the_refresh_command_writes_the_page_the_history_and_the_json_and_exits_1_when_something_moved(
        table, monkeypatch, tmp_path, capsys):
    index = ["0.18.9", "0.19.0", "0.20.0"]
    results = {"0.18.9": bad(), "0.19.0": GOOD, "0.20.0": GOOD}
    monkeypatch.setattr(listing, "index_releases", lambda p: (index, "the package index"))
    monkeypatch.setattr(known, "measure", lambda r, **kw: lambda rel: {**results[rel], "release": rel})
    seen = []
    monkeypatch.setattr(kprefetch, "needs_of", lambda pairs: pairs)
    wrote = []
    monkeypatch.setattr(refresh, "write_ranges", lambda: wrote.append(1) or [])
    monkeypatch.setattr(refresh.diff, "diff", lambda b, a, opt, package: {"before": b, "after": a, "files": [],
                                                                          "commits": (None, None)})
    monkeypatch.setattr(kprefetch, "prefetch", lambda needs, progress: seen.append(needs) or ({}, []))
    args = ["--only", "B5", "--page", str(tmp_path / "p.md"), "--history", str(tmp_path / "h.json"),
            "--json", str(tmp_path / "r.json"), "--no-progress"]
    assert refresh.main(args) == 0
    out = capsys.readouterr().out
    assert "B5: 3 releases of deepspeed: 0.18.9, 0.19.0, 0.20.0" in out and "nothing moved" in out and wrote == [1]
    assert [stack for _, stack in seen[0]] == [{"deepspeed": r} for r in index]  # installed up front, each once
    h = json.loads((tmp_path / "h.json").read_text())
    assert list(h["series"]["B5"]["releases"]) == index and h["series"]["B5"]["releases"]["0.20.0"]["by"] == \
        "scripts/refresh_table"
    text = (tmp_path / "p.md").read_text()
    assert text.startswith("# The upstream table, refreshed")
    assert "| 0.18.9 | affected | x | 0.400 | scripts/refresh_table, " in text  # the history, every release
    assert json.loads((tmp_path / "r.json").read_text())["recipes"][0]["recipe"] == "B5"
    results["0.20.0"] = bad()  # a new release regresses: exit 1, and the history says the release moved
    assert refresh.main(args) == 1
    assert "B5 on deepspeed 0.20.0: was not-affected" in capsys.readouterr().out
    results.update({r: SKIP for r in index})
    assert refresh.main(args) == 3  # nothing could run


def test_the_refresh_refuses_an_unknown_recipe_and_a_missing_folder_before_anything_runs(tmp_path):
    with pytest.raises(kconfig.ConfigError, match="--only \\['B99'\\]: the recipes are B1"):
        refresh.main(["--only", "B99", "--page", str(tmp_path / "p.md"), "--history", str(tmp_path / "h.json")])
    with pytest.raises(kconfig.ConfigError, match="does not exist"):
        refresh.main(["--page", str(tmp_path / "no" / "p.md"), "--history", str(tmp_path / "h.json")])


def test_a_bugs_timeline_draws_each_release_at_its_worst_ratio_by_verdict_and_each_pin_between_its_releases():
    from gradkit.notebooks import plot_style, verdict_plots

    assert verdict_plots.worst_ratio({"ratios": [0.9, 0.2, 1.5]}) == 0.2
    assert verdict_plots.worst_ratio({"ratios": [0.9, 4.0, None]}) == 4.0
    assert verdict_plots.worst_ratio({"ratios": []}) is None and verdict_plots.worst_ratio({"ratios": [None]}) is None
    s = {"bug": "B5", "axis": "deepspeed", "with": {"transformers": "5.3.0"}, "releases": {
        "0.19.0": GOOD, "0.14.0": SKIP, "0.18.9": bad("first and last", 0.35)}}
    fig = verdict_plots.timeline({"B5": s}, [PIN])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.14.0", "0.18.9", "0.19.0"]
    marks = [(tuple(line.get_xdata()), tuple(line.get_ydata()), line.get_color()) for line in ax.lines
             if line.get_marker() in ("o", "x")]
    assert (1, 0.35) == (marks[1][0][0], marks[1][1][0]) and marks[1][2] == plot_style.VERDICT_COLOURS["affected"]
    assert marks[0][1][0] == 0.35 / 2 and marks[0][2] == plot_style.VERDICT_COLOURS["cannot-run"]  # at the foot
    assert marks[2][2] == plot_style.VERDICT_COLOURS["not-affected"]
    assert any(tuple(line.get_xdata()) == (1.5, 1.5) for line in ax.lines)  # the pin, between 0.18.9 and 0.19.0
    assert "B5: deepspeed releases (transformers 5.3.0 throughout)" == ax.get_title(loc="left")
    assert plot_style.smallest_shown_points(fig)[0] >= plot_style.MIN_POINTS


def test_the_pinned_ranges_are_written_into_each_pages_ranges_block_and_the_repositorys_are_current(tmp_path, repo):
    (tmp_path / "docs").mkdir()
    for name in refresh.RANGES_PAGES:
        (tmp_path / name).write_text("head\n<!-- gradkit:table RANGES -->\nold\n<!-- /gradkit:table -->\ntail\n")
    assert refresh.write_ranges(tmp_path) == list(refresh.RANGES_PAGES)
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("head\n<!-- gradkit:table RANGES -->\n<sub>generated by `scripts/refresh_table --ranges-only`")
    assert expectations.ranges_short() in text and text.endswith("<!-- /gradkit:table -->\ntail\n")
    assert expectations.ranges_table() in (tmp_path / "docs/bugs.md").read_text()
    (tmp_path / "README.md").write_text("no block\n")
    assert refresh.write_ranges(tmp_path) == ["docs/bugs.md"]
    for name, make in refresh.RANGES_PAGES.items():  # the repository's pages say what kit/judge/pins.py says now
        assert make() in (repo / name).read_text(), f"{name}: run scripts/refresh_table --ranges-only"
    short = {r.split(" | ")[0].strip("| "): r for r in expectations.ranges_short().splitlines()[2:]}
    assert short["B5"] == "| B5 | deepspeed | 0.15.2 (0.15.1 without it) | 0.19.0 (0.18.6 with it) | - | - |"
    assert short["B6"] == ("| B6 | deepspeed | before 0.14.4, the oldest that runs here | no release fixes it | - | "
                           "[B6](docs/reports/B6/report.md) |")  # the report gradkit report --known B6 verified
    assert set(pins.START_SHORT) == set(pins.START_HIDDEN)  # each hidden start said in a few words too
    assert short["B1"].endswith("| 4.46.2 (4.46.1 without it) | 5.10.1 (5.9.0 with it) | 5 | - |")


def _done(table, **kw):
    return {"recipe": table, "measured": {}, "pins": [], "new": [], "anchor": "0.19.0", "changes": [], **kw}


def test_the_page_says_when_no_release_is_newer_and_cuts_long_reasons_and_diffs_to_what_a_reader_takes_in(
        table, monkeypatch):
    """No newer release: said in one line. A new release's reason: its first 120 characters; a skipped release in the
    history: its first 100; a change's diff: its first 12 lines."""
    assert "No release of deepspeed newer than the table's 0.19.0 on the index." in refresh.page([_done(table)], [],
                                                                                                "d", 1.0, "idx")
    reason = "".join(f"{i % 10}" for i in range(300))
    new = [{"release": "0.20.0", "result": {**SKIP, "reason": reason}, "same": None}]
    text = refresh.page([_done(table, new=new)], [], "d", 1.0, "idx")
    assert f"- 0.20.0: cannot-run ({reason[:120]}): not compared" in text and "No release of" not in text
    rows = refresh.history_table({"releases": {"0.18.9": {**SKIP, "reason": reason}, "0.19.0": GOOD}})
    assert f"| 0.18.9 | cannot-run | skipped: {reason[:100]} | - |" in rows[2] and "| 0.19.0 | not-affected | - |" in rows[3]
    monkeypatch.setattr(refresh.diff, "diff_text", lambda d: "\n".join(f"line {i}" for i in range(20)))
    change = {"before": "0.19.1", "after": "0.19.2", "from": GOOD, "to": bad(), "diff": {}}
    monkeypatch.setattr(refresh.search, "describe", lambda ch: "0.19.1 -> 0.19.2")
    text = refresh.page([_done(table, changes=[change])], [], "d", 1.0, "idx")
    assert "    line 11" in text and "    line 12" not in text


def test_a_change_among_newer_releases_is_found_when_every_one_differs_and_its_diff_takes_either_sides_optimizer(
        table, monkeypatch):
    """Every release newer than the table measures otherwise: the change among them is still searched (from the
    newest pinned one); its diff follows the optimizer of whichever side names one. Looked up from what was
    measured, so not re-measured: not said to be confirmed. ``--full`` confirms each change it finds."""
    index = ["0.18.9", "0.19.0", "0.19.2", "0.20.0"]
    results = {"0.18.9": bad(), "0.19.0": GOOD, "0.19.2": {**bad("y"), "optimizer": "Adam"}, "0.20.0": bad("y")}
    monkeypatch.setattr(known, "measure", lambda r, **kw: lambda rel: {**results[rel], "release": rel})
    opts = []
    monkeypatch.setattr(refresh.diff, "diff", lambda b, a, opt, package: opts.append(opt) or {"files": []})
    done = refresh.refresh_one(table, index, False, "cpu", 60)
    assert [(c["before"], c["after"]) for c in done["changes"]] == [("0.19.0", "0.19.2")]
    assert opts == ["Adam"] and not done["changes"][0].get("confirmed")
    done = refresh.refresh_one(table, index, True, "cpu", 60)
    assert done["changes"] and all(c["confirmed"] for c in done["changes"])


def test_the_refresh_command_says_what_it_could_not_prepare_its_time_and_shows_progress_unless_asked_not_to(
        table, monkeypatch, tmp_path, capsys):
    index = ["0.18.9", "0.19.0"]
    monkeypatch.setattr(listing, "index_releases", lambda p: (index, "idx"))
    monkeypatch.setattr(known, "measure", lambda r, **kw: lambda rel: {**(bad() if rel == "0.18.9" else GOOD),
                                                                        "release": rel})
    monkeypatch.setattr(kprefetch, "needs_of", lambda pairs: pairs)
    monkeypatch.setattr(refresh, "write_ranges", lambda: [])
    shown = []
    monkeypatch.setattr(kprefetch, "prefetch", lambda needs, progress: shown.append(progress) or
                        ({}, ["deepspeed 0.18.9: the index has no wheel"]))
    args = ["--only", "B5", "--page", str(tmp_path / "p.md"), "--history", str(tmp_path / "h.json")]
    refresh.main(args)
    refresh.main(args + ["--no-progress"])
    assert shown == [True, False]
    assert "  not prepared: deepspeed 0.18.9: the index has no wheel" in capsys.readouterr().out
    took = int(re.search(r"on \S+ in (\d+) s", (tmp_path / "p.md").read_text()).group(1))
    assert 0 <= took < 600  # the seconds the refresh took, not a clock's reading


def test_the_refresh_writes_the_sites_page_and_the_repositorys_pages_and_helps_with_its_summary(repo):
    import inspect

    assert refresh.PAGE == repo / "docs" / "refresh.md"
    assert inspect.signature(refresh.write_ranges).parameters["root"].default == repo
    assert refresh.parser().description == refresh.__doc__.split("\n\n")[0] and "refresh" in refresh.parser().description
