"""A known bug's fix, verified as `gradkit report --known` verifies it: the kit's patch applied to the release in an
overlay of its own (`0.19.8+b10`), then the standalone reproduction and the kit's oracle on both sides. The release
must reproduce and be affected, the patched one must not; a patch that does not apply, or a judgement that goes the
wrong way, is said and never called verified. The fix of B10 verified end to end on real worlds: notebook 08's
section 7 (``tests/test_notebooks.py``)."""
import dataclasses
import hashlib
import json

import pytest

from gradkit import config
from gradkit.commands import fix, report
from gradkit.judge import oracle
from gradkit.stacks import fixes, patched


def test_a_patch_is_named_by_the_local_label_of_a_release_and_one_that_does_not_apply_is_refused_in_its_own_words(
        tmp_path):
    assert patched.split("0.19.8+b10") == ("0.19.8", "b10")
    assert patched.split("0.19.8") == ("0.19.8", None) and patched.split("0.19.8+cpu") == ("0.19.8+cpu", None)
    # several patches, in order (B10's on top of B9's); one the kit does not hold makes the label the release's own
    assert patched.split("0.19.8+b9.b10") == ("0.19.8", "b9.b10") and patched.split("0.19.8+b9.b99")[1] is None
    one = [patched.patch_file("deepspeed", n).read_bytes() for n in ("b9", "b10")]
    assert patched.digest("deepspeed", "b10") == hashlib.sha256(one[1]).hexdigest()  # one patch: its file's sha256
    assert patched.digest("deepspeed", "b9.b10") == hashlib.sha256(one[0] + one[1]).hexdigest() != \
        patched.digest("deepspeed", "b10.b9")
    base = tmp_path / "base" / "deepspeed" / "runtime" / "zero"
    base.mkdir(parents=True)
    for name in ("stage3.py", "stage_1_and_2.py"):
        (base / name).write_text("nothing the patch expects\n")
    with pytest.raises(config.ConfigError, match="(?s)the patch b10 does not apply to deepspeed 0.18.6: .*Hunk #1 FAILED"):
        patched.build("deepspeed", "0.18.6+b10", tmp_path / "base", tmp_path / "deepspeed-0.18.6+b10")
    with pytest.raises(config.ConfigError, match="holds no patch 'b99'"):
        patched.build("deepspeed", "0.18.6+b99", tmp_path / "base", tmp_path / "x")


def test_a_fix_whose_judgement_goes_the_wrong_way_is_not_called_verified(tmp_path, monkeypatch):
    """The patched release still reproducing (a planted outcome) leaves the fix unverified: exit 3, said."""
    monkeypatch.setitem(fix.FIXES, "B10", dataclasses.replace(fix.FIXES["B10"], stages=(2,)))
    monkeypatch.setattr(fix, "run_script", lambda path, w, stack, stage, t: (1, "REPRODUCED: 2 of 6 steps off"))
    monkeypatch.setattr(fix, "run_test", lambda path, stack, t: (1, "FAILED b10_test.py::TestUnscaleWhenScaleGrows"))
    good = {"verdict": oracle.AFFECTED, "step": "x"}
    monkeypatch.setattr(fix.recipes, "measure", lambda recipe, w, timeout_s: (lambda release: dict(good)))
    assert report.main(["--known", "B10", "--sweep", "none", "--out", str(tmp_path)]) == 3
    assert "the fix is **NOT verified**" in (tmp_path / "report.md").read_text()
    assert not json.loads((tmp_path / "verification.json").read_text())["verified"]


def test_a_regression_test_is_failed_only_where_pytest_failed_one_and_a_crash_is_said_as_such(monkeypatch, tmp_path):
    """torchrun's status is 1 for any rank's failure: a failed assertion is 1, a test that never ran (a collection
    error, a crash) is kept apart (3) with what it printed."""
    said = {"failed": (1, "FAILED b10_test.py::T::test[1] - AssertionError\n1 failed, 2 passed in 3.1s\n", ""),
            "error": (1, "ERROR b10_test.py - ModuleNotFoundError: No module named 'unit'\n1 error in 0.2s\n", ""),
            "crash": (1, "", "Traceback (most recent call last):\nRuntimeError: gloo\n"),
            "passed": (0, "PASSED b10_test.py::T::test[1]\n3 passed in 9.0s\n", ""),
            "coloured": (1, "\x1b[31mFAILED\x1b[0m b10_test.py::\x1b[1mT::test[1]\x1b[0m\n", "")}
    got = {}
    for what in said:
        monkeypatch.setattr(fix.scripts, "torchrun", lambda *a, what=what, **k: said[what])
        got[what] = fix.run_test(tmp_path / "t.py", {}, 60)
    assert {w: rc for w, (rc, _) in got.items()} == {"failed": 1, "error": 3, "crash": 3, "passed": 0,
                                                          "coloured": 1}, got
    assert "RuntimeError: gloo" in got["crash"][1] and got["failed"][1].startswith("FAILED b10_test.py::T::test[1]")


def test_the_ranges_table_links_a_fix_only_where_its_report_says_verified(tmp_path, monkeypatch):
    """The README's ranges name the kit's fix of a bug from its report's verification, never from the patch alone."""
    from gradkit.stacks import fixes

    monkeypatch.setattr(fixes.kconfig, "repo_path", lambda p: tmp_path / p)
    assert fixes.verified_report("B10") is None  # no report written
    (tmp_path / "docs/reports/B10").mkdir(parents=True)
    (tmp_path / "docs/reports/B10/verification.json").write_text(json.dumps({"verified": False}))
    assert fixes.verified_report("B10") is None
    (tmp_path / "docs/reports/B10/verification.json").write_text(json.dumps({"verified": True}))
    assert fixes.verified_report("B10") == "docs/reports/B10/report.md"
    for doc in ([{"verified": True}], "verified", {"verified": "no"}):  # the watch calls this: never a raise
        (tmp_path / "docs/reports/B10/verification.json").write_text(json.dumps(doc))
        assert fixes.verified_report("B10") is None
    (tmp_path / "docs/reports/B3").mkdir(parents=True)  # a report of a bug the kit holds no fix for is not linked
    (tmp_path / "docs/reports/B3/verification.json").write_text(json.dumps({"verified": True}))
    assert fixes.verified_report("B3") is None


def test_a_sweep_never_reuses_a_record_measured_on_a_patch_since_edited(monkeypatch):
    """A patched release's records name the patch by its digest: the sweep resumes from a record only where the
    patch is the one it was measured on (an edited patch runs its points again; ``report --known`` after an edit)."""
    from gradkit.commands.sweep import run as sweep_run
    from gradkit.commands.sweep import spec as sweep_spec

    stack = {"deepspeed": "0.19.8+b10"}
    before = sweep_spec.release_of(stack)
    assert before.startswith("0.19.8+b10 (b10.diff ") and sweep_spec.release_of({"deepspeed": "0.19.8"}) == "0.19.8"
    spec = sweep_spec.check_spec({"axes": {"ga": [1]}, "stacks": [stack]})
    rec = {"release": before, "stack": stack, "spec_key": sweep_spec.spec_key(spec), "id": "x", "verdict": "affected"}
    assert sweep_run.current([rec], spec) == [rec]
    monkeypatch.setattr(patched, "digest", lambda package, name: "0" * 64)  # the patch edited since
    assert sweep_spec.release_of(stack) != before and sweep_run.current([rec], spec) == []


def test_the_sweep_of_a_fix_counts_each_point_on_both_sides_and_says_where_another_bug_shows(monkeypatch, tmp_path):
    """``sweep_both`` pairs each point's two records: broken (not-affected -> affected: a fix must leave none), fixed
    (the other way) and renamed (affected on both sides, by another bug with the patch: B9's ZeRO-0 points patched
    show B10). The worlds are replaced by records; tests/test_notebooks.py runs the real ones."""
    side = {"0.19.8": {"deepspeed": "0.19.8"}, "0.19.8+b9": {"deepspeed": "0.19.8+b9"}}
    rows = [({"ga": 1}, (oracle.AFFECTED, "B9"), (oracle.AFFECTED, "B10")),
            ({"ga": 2}, (oracle.AFFECTED, "B9"), (oracle.NOT_AFFECTED, None)),
            ({"ga": 4}, (oracle.NOT_AFFECTED, None), (oracle.AFFECTED, None)),
            ({"ga": 8}, (oracle.AFFECTED, "B3"), (oracle.AFFECTED, "B3")),
            ({"ga": 16}, (oracle.CANNOT_RUN, None), (oracle.AFFECTED, "B10"))]
    recs = [{"point": p, "versions": {"deepspeed": name}, "verdict": v, "explained_by": why}
            for p, *both in rows for name, (v, why) in zip(side, both)]
    monkeypatch.setattr(fix.sweep_run, "run", lambda spec, out, progress: recs)
    s = fix.sweep_both("scripts/sweeps/quick.yaml", side, tmp_path, False)
    assert s["points"] == 5 and s["broken"] == ['{"ga": 4}'] and s["fixed"] == ['{"ga": 2}']
    assert s["renamed"] == {"B9 -> B10": 1}  # ga 8: the same bug on both sides; ga 16: not affected on both
    assert s["affected"] == {"0.19.8": 3, "0.19.8+b9": 4} and s["not_run"] == {"0.19.8": 1, "0.19.8+b9": 0}


def test_each_fix_is_verified_at_exactly_the_zero_stages_its_committed_report_verified():
    for bug, f in fixes.FIXES.items():
        doc = json.loads(config.repo_path(f"docs/reports/{bug}/verification.json").read_text())
        assert doc["verified"] is True and doc["stages"] == list(f.stages), bug
        assert fixes.verified_report(bug) == f"docs/reports/{bug}/report.md"
