"""A known bug's fix, verified as `gradkit report --known` verifies it: the kit's patch applied to the release in an
overlay of its own (`0.19.8+b10`), then the standalone reproduction and the kit's oracle on both sides. The release
must reproduce and be affected, the patched one must not; a patch that does not apply, or a judgement that goes the
wrong way, is said and never called verified."""
import dataclasses
import json

import pytest

from gradkit import config
from gradkit.commands import fix, report
from gradkit.judge import oracle
from gradkit.stacks import patched, versions


def test_a_patch_is_named_by_the_local_label_of_a_release_and_one_that_does_not_apply_is_refused_in_its_own_words(
        tmp_path):
    assert patched.split("0.19.8+b10") == ("0.19.8", "b10")
    assert patched.split("0.19.8") == ("0.19.8", None) and patched.split("0.19.8+cpu") == ("0.19.8+cpu", None)
    base = tmp_path / "base" / "deepspeed" / "runtime" / "zero"
    base.mkdir(parents=True)
    for name in ("stage3.py", "stage_1_and_2.py"):
        (base / name).write_text("nothing the patch expects\n")
    with pytest.raises(config.ConfigError, match="(?s)the patch b10 does not apply to deepspeed 0.18.6: .*Hunk #1 FAILED"):
        patched.build("deepspeed", "0.18.6+b10", tmp_path / "base", tmp_path / "deepspeed-0.18.6+b10")
    with pytest.raises(config.ConfigError, match="holds no patch 'b99'"):
        patched.build("deepspeed", "0.18.6+b99", tmp_path / "base", tmp_path / "x")


@pytest.mark.world
def test_the_b10_fix_is_verified_end_to_end_on_the_installed_release_and_on_it_patched(tmp_path, monkeypatch):
    """ZeRO-2 only here (the report runs ZeRO-2 and 3): the reproduction exits 1 on the release and 0 patched; the
    bug's recipe is affected on the release, named B10, and not-affected patched; the report says so."""
    monkeypatch.setitem(fix.FIXES, "B10", dataclasses.replace(fix.FIXES["B10"], stages=(2,)))
    release = versions.installed_version("deepspeed")
    code = report.main(["--known", "B10", "--sweep", "none", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "verification.json").read_text())
    assert code == 0 and doc["verified"], doc
    runs = doc["reproduction"]
    assert runs[f"{release} ZeRO-2"]["exit"] == 1 and "REPRODUCED: 2 of 6 steps off" in runs[f"{release} ZeRO-2"]["output"]
    assert runs[f"{release}+b10 ZeRO-2"]["exit"] == 0 and f"(deepspeed {release}+b10)" in runs[f"{release}+b10 ZeRO-2"][
        "output"]
    assert "step 3: loss scale 256 -> 512, applied / gradient 0.50" in runs[f"{release} ZeRO-2"]["output"]
    assert doc["recipe"][release]["verdict"] == oracle.AFFECTED and doc["recipe"][release]["explained_by"] == "B10"
    assert doc["recipe"][f"{release}+b10"]["verdict"] == oracle.NOT_AFFECTED
    text = (tmp_path / "report.md").read_text()
    assert "the fix is **verified**" in text and "```diff" in text and (tmp_path / "fix.diff").exists()


def test_a_fix_whose_judgement_goes_the_wrong_way_is_not_called_verified(tmp_path, monkeypatch):
    """The patched release still reproducing (a planted outcome) leaves the fix unverified: exit 3, said."""
    monkeypatch.setitem(fix.FIXES, "B10", dataclasses.replace(fix.FIXES["B10"], stages=(2,)))
    monkeypatch.setattr(fix, "run_script", lambda path, w, stack, stage, t: (1, "REPRODUCED: 2 of 6 steps off"))
    good = {"verdict": oracle.AFFECTED, "step": "x"}
    monkeypatch.setattr(fix.recipes, "measure", lambda recipe, w, timeout_s: (lambda release: dict(good)))
    assert report.main(["--known", "B10", "--sweep", "none", "--out", str(tmp_path)]) == 3
    assert "the fix is **NOT verified**" in (tmp_path / "report.md").read_text()
    assert not json.loads((tmp_path / "verification.json").read_text())["verified"]
