"""``gradkit bisect`` without a world: the release list (index, cache, offline), one release's result in words, a
probe's measure, the search's edges, the sentences and the table, the code that changed between two releases, and
the command's output and exit status with the measure replaced. tests/test_bisect.py runs it on real releases."""
import json
import subprocess
import time
from types import SimpleNamespace

import pytest

from gradkit.commands import bisect
from gradkit.commands.bisect import diff, known, listing, result, search
from gradkit.judge import oracle
from gradkit.stacks import versions
from gradkit import config as kconfig

from tests.test_bisect import GOOD, bad, measuring

SKIP = {"verdict": oracle.CANNOT_RUN, "step": None, "ratios": [], "reason": "does not install here"}


# ---------------------------------------------------------------------------------------------- releases

def test_the_installed_release_runs_without_an_overlay_and_any_other_in_one(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda p: {"deepspeed": "0.18.6+cpu", "accelerate": "1.2.0",
                                                                  "transformers": "5.23.0"}[p])
    assert listing.stack_of("0.18.6") == {} and listing.stack_of("0.18.5") == {"deepspeed": "0.18.5"}
    # transformers 4.45 - 4.46 import here only beside accelerate 1.0.1; 4.47.0 and later beside the installed one
    assert listing.stack_of("4.46.3", "transformers") == {"transformers": "4.46.3", "accelerate": "1.0.1"}
    assert listing.stack_of("4.47.0", "transformers") == {"transformers": "4.47.0"}
    assert listing.stack_of("5.23.0", "transformers") == {}
    assert versions.accelerate_for("4.45.2") == "1.0.1" and versions.accelerate_for("5.3.0") is None
    assert listing.stack_of("1.2.0", "accelerate") == {} and listing.stack_of("1.0.1", "accelerate") == {"accelerate": "1.0.1"}
    assert [v for v in ("0.18.6", "1.0", "0.18.6rc1", "1.0.0.dev0", "0.18.6.post1") if listing._final(v)] == ["0.18.6", "1.0"]


@pytest.fixture
def index(monkeypatch, tmp_path):
    """The kit's cache in tmp_path, pip's answer chosen by the test, the overlays and the installed release faked."""
    monkeypatch.setattr(kconfig, "cache_dir", lambda: tmp_path / "cache")  # not made yet: the first write makes it
    overlays = tmp_path / "overlays"
    for name, complete in (("deepspeed-0.17.0", True), ("deepspeed-0.16.0", False), ("deepspeed-0.15.0rc1", True)):
        (overlays / name).mkdir(parents=True)
        if complete:
            (overlays / name / ".complete").write_text("")
    monkeypatch.setattr(versions, "overlay_root", lambda: overlays)
    monkeypatch.setattr(versions, "installed_version", lambda p: "0.18.6+cpu")
    said = {"stdout": "deepspeed (0.10.0)\nAvailable versions: 0.10.0, 0.9.0, 0.10.0rc1, 0.2.0, 0.9.1\n", "calls": 0}

    def run(cmd, capture_output=False, text=False, timeout=None, **kw):  # as subprocess.run answers
        said["calls"] += 1
        assert timeout, "pip must not hang a bisect"
        if said.get("raise"):
            raise said["raise"]
        out = said["stdout"] if text else said["stdout"].encode()
        return subprocess.CompletedProcess(cmd, 0, out if capture_output else None, "")

    monkeypatch.setattr(listing.subprocess, "run", run)
    return tmp_path / "cache" / "releases" / "deepspeed.json", said


def test_the_index_is_asked_once_a_day_its_final_releases_in_order_and_kept(index):
    cache, said = index
    found, where = listing.index_releases()
    assert found == ["0.2.0", "0.9.0", "0.9.1", "0.10.0"] and where == "the package index"  # rc left out, in order
    held = json.loads(cache.read_text())
    assert held["releases"] == found and abs(held["fetched"] - time.time()) < 60
    said["stdout"] = "Available versions: 0.3.0\n"
    again, where = listing.index_releases()
    assert again == found and said["calls"] == 1 and where.startswith("the package index (cached ")
    assert time.strftime("%Y-%m-%d", time.gmtime()) in where
    cache.write_text(json.dumps({"fetched": time.time() - listing.INDEX_MAX_AGE_S - 5, "releases": ["0.1.0"]}))
    assert listing.index_releases() == (["0.3.0"], "the package index") and said["calls"] == 2  # a day old: asked


def test_the_cached_list_is_kept_for_exactly_a_day(index, monkeypatch):
    cache, said = index
    now = 1_700_000_000.0
    monkeypatch.setattr(listing.time, "time", lambda: now)
    cache.parent.mkdir(parents=True)
    for age, asked in ((86399.0, 0), (86400.0, 1), (86401.0, 1), (3600.0, 0)):
        said["calls"] = 0
        cache.write_text(json.dumps({"fetched": now - age, "releases": ["0.1.0"]}))
        found, where = listing.index_releases()
        assert said["calls"] == asked, (age, where)
        assert found == (["0.2.0", "0.9.0", "0.9.1", "0.10.0"] if asked else ["0.1.0"])


def test_offline_the_cached_list_is_used_and_said_else_the_releases_the_kit_already_has(index):
    cache, said = index
    said["raise"] = subprocess.TimeoutExpired("pip", 60)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"fetched": 86400.0 * 3, "releases": ["0.1.0", "0.2.0"]}))
    found, where = listing.index_releases()
    assert found == ["0.1.0", "0.2.0"]
    assert where == "the package index as cached on 1970-01-04 (the index cannot be reached now)"
    said["raise"], said["stdout"] = None, "pip says nothing useful\n"  # no "Available versions:" line
    assert listing.index_releases()[0] == ["0.1.0", "0.2.0"]
    cache.write_text("not json")
    found, where = listing.index_releases()  # no list at all: the overlays complete here, and the installed one
    assert found == ["0.17.0", "0.18.6+cpu"] and "already in the kit's cache and the installed one" in where
    said["raise"] = OSError("no pip")
    cache.unlink()
    assert listing.index_releases()[0] == ["0.17.0", "0.18.6+cpu"]


def test_the_releases_to_bisect_are_the_given_ones_in_order_or_the_indexs_between_from_and_to(index, monkeypatch):
    monkeypatch.setattr(listing, "index_releases", lambda p=listing.PACKAGE: (["0.2.0", "0.9.0", "0.9.1", "0.10.0"], "idx"))
    assert listing.release_list(None, "installed", " 0.9.1, installed,,0.2.0 ") == (["0.9.1", "0.18.6", "0.2.0"],
                                                                                  "--releases")
    with pytest.raises(kconfig.ConfigError, match="at least two releases"):
        listing.release_list(None, "installed", "0.9.1, ")
    with pytest.raises(kconfig.ConfigError, match="release number"):
        listing.release_list(None, "installed", "0.9.1,newest")
    assert listing.release_list(None, "installed") == (["0.2.0", "0.9.0", "0.9.1", "0.10.0", "0.18.6"], "idx")
    assert listing.release_list("0.9.0", "0.9.1")[0] == ["0.9.0", "0.9.1"]  # both ends included
    assert listing.release_list("0.9.1", "installed")[0] == ["0.9.1", "0.10.0", "0.18.6"]
    with pytest.raises(kconfig.ConfigError, match="between 0.9.1 and 0.9.1 idx has 1 release"):
        listing.release_list("0.9.1", "0.9.1")
    with pytest.raises(kconfig.ConfigError, match="between the first release and 0.2.0 idx has 1 release"):
        listing.release_list(None, "0.2.0")
    with pytest.raises(kconfig.ConfigError, match="release number"):
        listing.release_list("zero", "installed")
    with pytest.raises(kconfig.ConfigError, match="release number"):
        listing.release_list(None, "newest")
    monkeypatch.setattr(versions, "installed_version", lambda p: "0.9.0")  # already in the index: not twice
    assert listing.release_list(None, "installed")[0] == ["0.2.0", "0.9.0"]
    monkeypatch.setattr(versions, "installed_version", lambda p: "0.19.0.dev0")  # a dev build is not a release
    assert listing.release_list("0.9.1", "installed")[0] == ["0.9.1", "0.10.0"]  # up to it, without it


# ---------------------------------------------------------------------------------------------- one release

def _summary(verdict, **row):
    return {"loops": [{"loop": "other", "verdict": oracle.NOT_AFFECTED, "steps": []},
                      {"loop": "manual", "verdict": verdict, "steps": [{"ratio": 0.5}, {"ratio": 0.25}], **row}],
            "control": {"verdict": oracle.NOT_AFFECTED}}


def test_one_releases_result_is_the_loops_verdict_and_the_step_in_words():
    recs = [{"role": "control", "optimizer": "Control", "dtype": "fp16"}, {"role": "measured"},
            {"role": "measured", "optimizer": "DeepSpeedZeroOptimizer", "dtype": "fp32", "judge_dtype": "bf16"},
            {"role": "measured", "optimizer": "Other", "dtype": "fp16"}]
    r = result.result_of(_summary(oracle.AFFECTED, matches="last micro-batch / N", cosine=0.9, misplaced_weight=0.5,
                                  explained_by="x", reason="ignored"), "manual", "0.18.6", recs)
    assert r == {"release": "0.18.6", "verdict": oracle.AFFECTED, "step": "last micro-batch / N", "ratios": [0.5, 0.25],
                 "cosine": 0.9, "misplaced_weight": 0.5, "explained_by": "x", "optimizer": "DeepSpeedZeroOptimizer",
                 "reason": None, "control": oracle.NOT_AFFECTED, "dtype": "bf16"}
    assert result.result_of(_summary(oracle.AFFECTED), "manual", "1", recs[-1:])["dtype"] == "fp16"
    tie = result.result_of(_summary(oracle.AFFECTED, ties=["a", "b"], matches="a"), "manual", "1", [])
    assert tie["step"] == "ambiguous between 'a' and 'b'" and tie["optimizer"] is None
    assert result.result_of(_summary(oracle.AFFECTED, matches="none", shape="sum x GA"), "manual", "1", [])["step"] \
        == "sum x GA"
    assert result.result_of(_summary(oracle.AFFECTED, shape="sum x GA"), "manual", "1", [])["step"] == "sum x GA"
    assert result.result_of(_summary(oracle.AFFECTED), "manual", "1", [])["step"] == "off, not named"
    good = result.result_of(_summary(oracle.NOT_AFFECTED, matches="global mean", reason="r"), "manual", "1", [])
    assert good["step"] is None and good["reason"] is None and good["ratios"] == [0.5, 0.25]
    skipped = result.result_of({**_summary(oracle.INCONCLUSIVE, reason="the control is off"), "control": None},
                               "manual", "1", [])
    assert skipped["reason"] == "the control is off" and skipped["control"] is None and skipped["step"] is None
    gone = result.result_of(_summary(oracle.AFFECTED), "engine", "1", [])
    assert gone == {"release": "1", "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [],
                    "reason": "the loop 'engine' did not run"}


def test_a_probe_records_step_is_said_per_stage_else_by_the_hypothesis_it_matches():
    assert result.step_words({"stages": [{"stage": 0, "matches": "sum (x GA)"}, {"stage": 1}]}) == \
        "stage 0: sum (x GA); stage 1: None"
    assert result.step_words({"stages": [], "matches": "m", "shape": "s"}) == "m"
    assert result.step_words({"shape": "s"}) == "s"
    assert result.step_words({}) == "off (this probe names no step)"


class _Probe(SimpleNamespace):
    def reason_key(self):
        return "why"


def _probe(recs=None, error=None):
    calls = []

    def run(**kw):
        calls.append(kw)
        if error:
            raise error
        return recs

    return _Probe(id="BX", packages={"torch": None, "deepspeed": None}, run=run, verdict_key="probe_verdict"), calls


def test_a_probes_measure_judges_its_case_by_the_worst_configuration_and_names_its_steps(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda p: "0.18.6")
    rec = lambda v, m, **kw: {"case": "measured", "probe_verdict": v, "verdict": "ignored", "matches": m,  # noqa: E731
                              "steps": [{"metrics": {"norm_ratio": 0.5, "cosine": 0.8}},
                                        {"metrics": {"norm_ratio": None, "cosine": 0.7}}], "why": "w", **kw}
    recs = [rec(oracle.NOT_AFFECTED, "global mean"),
            rec(oracle.AFFECTED, "b", optimizer="SGD", dtype="bf16", attribution={"misplaced_weight": 0.25}),
            rec(oracle.AFFECTED, "a"), rec(oracle.AFFECTED, "a"),
            {"case": "control", "probe_verdict": oracle.AFFECTED, "verdict": oracle.AFFECTED}]
    probe, calls = _probe(recs)
    measure = result.probe_measure(probe, {"world_sizes": [2]}, "measured")
    assert measure("0.18.5") == {"release": "0.18.5", "verdict": oracle.AFFECTED, "step": "a; b", "ratios": [0.5, None],
                                 "cosine": 0.7, "misplaced_weight": 0.25, "dtype": "bf16", "reason": None,
                                 "optimizer": "SGD"}
    assert calls == [{"world_sizes": [2], "stacks": [{"deepspeed": "0.18.5"}]}]
    measure("0.18.6")
    assert calls[-1]["stacks"] == [{}]
    odd = [{"case": "measured", "probe_verdict": "odd", "verdict": "odd", "why": "w"}, rec(oracle.CANNOT_RUN, None)]  # unknown ranks last
    res = result.probe_measure(_probe(odd)[0], {}, "measured")("0.18.5")
    assert res["verdict"] == oracle.CANNOT_RUN and res["reason"] == "w" and res["step"] is None
    assert res["ratios"] == [0.5, None] and res["dtype"] == "fp32" and res["misplaced_weight"] is None
    one = result.probe_measure(_probe([{"case": "measured", "probe_verdict": oracle.AFFECTED, "verdict": "x", "why": "w",
                                        "metrics": {"norm_ratio": 0.3}}])[0], {}, "measured")("0.18.5")
    assert one["ratios"] == [0.3] and one["cosine"] is None  # a record without steps is its own one step
    flat = [{"case": "measured", "verdict": oracle.AFFECTED, "probe_verdict": oracle.NOT_AFFECTED,
             "metrics": {"norm_ratio": 1.0}, "why": "w"}]  # the probe's own verdict, not the record's
    res = result.probe_measure(_probe(flat)[0], {}, "measured")("0.18.5")
    assert res["ratios"] == [1.0] and res["step"] is None and res["reason"] is None  # its own metrics, one step
    words = result.probe_measure(_probe(recs)[0], {}, "measured", words=lambda r: r["matches"].upper())
    assert words("0.18.5")["step"] == "A; B"
    none = result.probe_measure(_probe([{"case": "control", "verdict": "v"}])[0], {}, "measured")("0.18.5")
    assert none == {"release": "0.18.5", "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [],
                    "reason": "the probe gave no record of the case 'measured'"}
    refused = result.probe_measure(_probe(error=versions.CannotRun("no wheel"))[0], {}, "measured")("0.18.5")
    assert refused == {"release": "0.18.5", "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [],
                       "reason": "no wheel"}
    with pytest.raises(kconfig.ConfigError, match=r"the BX probe's stack names \['torch', 'deepspeed'\], not 'accelerate'"):
        result.probe_measure(probe, {}, "measured", axis="accelerate")


def test_a_configs_measure_runs_the_checks_probe_on_the_release_and_a_release_that_cannot_install_is_skipped(monkeypatch):
    from gradkit.commands import check
    from gradkit.probes import ds_config

    monkeypatch.setattr(versions, "installed_version", lambda p: "0.18.6")
    calls = []

    def run(cfg, loops, world_size, stack, device, timeout_s, steps, model):
        calls.append((cfg, loops, world_size, stack, device, timeout_s, steps, model))
        if stack.get("deepspeed") == "0.1.0":
            raise versions.CannotRun("no wheel for this python")
        return [{"role": "measured", "optimizer": "SGD"}]

    monkeypatch.setattr(ds_config, "run", run)
    monkeypatch.setattr(check, "summarise", lambda recs: _summary(oracle.AFFECTED, matches="m"))
    measure = result.measure_with("cfg", "manual", 2, "cpu", 60.0, 3, model="moe")
    res = measure("0.18.5")
    assert res["verdict"] == oracle.AFFECTED and res["step"] == "m" and res["optimizer"] == "SGD"
    assert calls == [("cfg", ("manual",), 2, {"deepspeed": "0.18.5"}, "cpu", 60.0, 3, "moe")]
    assert measure("0.1.0") == {"release": "0.1.0", "verdict": oracle.CANNOT_RUN, "step": None, "ratios": [],
                                "reason": "no wheel for this python"}


def test_a_change_is_a_change_of_verdict_of_the_steps_shape_or_of_the_measured_step_beyond_the_dtypes_tolerance():
    off = {"verdict": oracle.AFFECTED, "step": None, "ratios": [0.227, 0.227], "cosine": 0.9, "dtype": "fp32"}
    assert result.same(off, {**off}) and result.differences(off, off) == []
    assert result.differences(off, {**off, "verdict": oracle.NOT_AFFECTED}) == ["verdict affected -> not-affected"]
    assert result.differences(off, {**off, "step": "x"}) == ["step 'None' -> 'x'"]
    # B1 from 5.5.2 to 5.6.1: both affected, no step named, the ratio from 0.227 to 0.908
    assert result.differences(off, {**off, "ratios": [0.908, 0.908]}) == ["ratio of step 1 0.227 -> 0.908",
                                                                          "ratio of step 2 0.227 -> 0.908"]
    # within fp32's tolerance (1e-4) is the same step, just past it is not; bf16's is 3e-2, the coarser of the two
    assert result.same(off, {**off, "ratios": [0.22709, 0.227]})
    assert not result.same(off, {**off, "ratios": [0.22711, 0.227]})
    assert result.same({**off, "dtype": "bf16"}, {**off, "ratios": [0.25, 0.25]})
    assert not result.same({**off, "dtype": "bf16"}, {**off, "ratios": [0.26, 0.25]})
    big = {**off, "ratios": [3.0]}  # a ratio far from 1: the tolerance is relative to it
    assert result.same(big, {**big, "ratios": [3.00029]}) and not result.same(big, {**big, "ratios": [3.00031]})
    # relative to the larger of the two, whichever side it is on (3.0003 vs 3.0 differ by just over 3.0 x 1e-4)
    assert result.same({**big, "ratios": [3.0003]}, big) and result.same(big, {**big, "ratios": [3.0003]})
    assert not result._apart(0.0, 1e-4, 1e-4) and result._apart(0.0, 2e-4, 1e-4)  # at the limit: the same
    assert result.differences(off, {**off, "ratios": [0.227]}) == ["2 judged steps -> 1"]
    assert result.differences(off, {**off, "cosine": 0.89}) == ["cosine 0.90000 -> 0.89000"]
    assert result.same(off, {**off, "cosine": 0.90009})
    assert result.differences({**off, "misplaced_weight": 0.5}, {**off, "misplaced_weight": 0.25}) == [
        "misplaced weight 0.500 -> 0.250"]
    assert result.same({**off, "misplaced_weight": 0.5}, {**off, "misplaced_weight": 0.50009})
    assert not result.same(off, {**off, "cosine": None}) and result.same({**off, "cosine": None}, {**off, "cosine": None})
    nan = {**off, "ratios": [float("nan")]}
    assert result.same(nan, {**nan}) and not result.same(nan, {**off, "ratios": [1.0]})
    assert not result.same({**off, "ratios": [float("inf")]}, {**off, "ratios": [1.0]})
    assert result.same({**off, "ratios": [float("inf")]}, {**off, "ratios": [float("inf")]})
    # two results that did not run are the same whatever their numbers; the verdict alone counts
    skip = {**off, "verdict": oracle.CANNOT_RUN}
    assert result.same(skip, {**skip, "ratios": [], "step": "y"})


# ---------------------------------------------------------------------------------------------- the search

def test_the_first_pass_takes_every_strideth_release_and_the_last():
    assert search.grid(13, 4) == [0, 4, 8, 12] and search.grid(10, 4) == [0, 4, 8, 9]
    assert search.grid(3, 0) == [0, 1, 2] and search.grid(1, 4) == [0] and search.grid(5, 1) == [0, 1, 2, 3, 4]


def test_the_first_pass_is_installed_up_front_for_the_probe_and_package_bisected(monkeypatch):
    from gradkit.stacks import prefetch as kprefetch
    from gradkit.probes import ds_config

    monkeypatch.setattr(versions, "installed_version", lambda p: "0.4.0")
    asked = []
    monkeypatch.setattr(kprefetch, "needs_of", lambda pairs: pairs)
    monkeypatch.setattr(kprefetch, "prefetch", lambda needs, progress: asked.append((needs, progress)) or ([], ["p"]))
    order = ["0.0.0", "0.1.0", "0.2.0", "0.3.0", "0.4.0"]
    assert search.prefetch(order, 2, progress=False) == ["p"]
    assert asked[-1] == ([(ds_config.CHECK, {"deepspeed": "0.0.0"}), (ds_config.CHECK, {"deepspeed": "0.2.0"})], False)
    search.prefetch(order, 4, probe="B1", axis="transformers")  # installed_version says 0.4.0 for any package
    assert asked[-1] == ([("B1", {"transformers": "0.0.0", "accelerate": "1.0.1"})], True)  # an old one's companion
    search.prefetch(["5.3.0", "0.4.0"], 4, probe="B1", axis="transformers", fixed={"deepspeed": "0.18.6"})
    assert asked[-1] == ([("B1", {"deepspeed": "0.18.6", "transformers": "5.3.0"}), ("B1", {"deepspeed": "0.18.6"})],
                         True)  # the installed transformers too: the held DeepSpeed is an overlay


def test_the_search_measures_each_release_once_tells_progress_and_reports_what_it_skipped():
    order = [f"0.{i}.0" for i in range(9)]
    results = {r: (bad() if i < 5 else GOOD) for i, r in enumerate(order)}
    results["0.8.0"] = SKIP
    measure, calls = measuring(results)
    heard = []
    found = search.search(order, measure, stride=4, progress=lambda rel, res: heard.append((rel, res["verdict"])))
    assert [(c["before"], c["after"], c["between"]) for c in found["changes"]] == [("0.4.0", "0.5.0", [])]
    # the last release does not run: the release below it that runs is the last anchor (0.7.0, not 0.4.0's GOOD)
    assert "0.7.0" in found["measured"] and found["skipped"] == [{"release": "0.8.0", "verdict": oracle.CANNOT_RUN,
                                                                  "reason": "does not install here"}]
    assert len(calls) == len(heard) and [r for r, _ in heard] == calls  # every run told, confirmations included
    assert sorted(found["measured"]) == sorted(set(calls)) and list(found["measured"]) == sorted(
        found["measured"], key=order.index)  # in release order
    assert found["order"] == order and found["stride"] == 4 and found["confirmations"] == {"0.4.0": True, "0.5.0": True}
    assert found["changes"][0]["from"]["release"] == "0.4.0" and found["changes"][0]["to"]["release"] == "0.5.0"
    plain = search.search(order, measuring(results)[0], stride=4, confirm=False)
    assert plain["confirmations"] == {} and "confirmed" not in plain["changes"][0]
    assert not search.describe(plain["changes"][0]).endswith("(NOT confirmed: a second run of one side gave another result)")


def test_a_release_at_either_end_that_runs_where_the_grids_did_not_is_an_anchor():
    order = [f"0.{i}.0" for i in range(9)]
    results = {r: SKIP for r in order}
    results.update({"0.1.0": bad(), "0.2.0": bad(), "0.6.0": GOOD, "0.7.0": GOOD})  # grid: 0, 4, 8 all skipped
    found = search.search(order, measuring(results)[0], stride=4)
    assert [(c["before"], c["after"]) for c in found["changes"]] == [("0.2.0", "0.6.0")]
    assert found["changes"][0]["between"] == ["0.3.0", "0.4.0", "0.5.0"]
    results.update({"0.4.0": bad()})  # one grid release runs; the first and last that run join it
    found = search.search(order, measuring(results)[0], stride=4)
    assert [(c["before"], c["after"]) for c in found["changes"]] == [("0.4.0", "0.6.0")]
    results.update({"0.0.0": GOOD, "0.4.0": SKIP})  # anchors 0.0.0 and 0.7.0 agree: a change and its undoing
    assert search.search(order, measuring(results)[0], stride=4)["changes"] == []  # between them are not seen
    nothing = search.search(order[:3], measuring({r: SKIP for r in order})[0], stride=1)
    assert nothing["changes"] == [] and len(nothing["skipped"]) == 3


def test_the_middle_release_is_measured_first_and_a_skipped_one_gives_way_to_its_nearest_neighbour():
    order = [f"0.{i}.0" for i in range(9)]
    results = {r: (bad() if i < 6 else GOOD) for i, r in enumerate(order)}
    results["0.4.0"] = SKIP
    measure, calls = measuring(results)
    found = search.search(order, measure, stride=8, confirm=False)
    assert calls == ["0.0.0", "0.8.0", "0.4.0", "0.3.0", "0.5.0", "0.6.0"]  # 4 skipped: 3 (nearer, lower) then 5
    assert [(c["before"], c["after"]) for c in found["changes"]] == [("0.5.0", "0.6.0")]


def test_between_two_anchors_the_middle_one_is_measured_first_then_the_middle_of_the_half_that_changes():
    order = [f"0.{i}.0" for i in range(13)]
    measure, calls = measuring({r: (bad() if i < 6 else GOOD) for i, r in enumerate(order)})
    found = search.search(order, measure, stride=4, confirm=False)
    assert calls == ["0.0.0", "0.4.0", "0.8.0", "0.12.0", "0.6.0", "0.5.0"]  # between 4 and 8: 6, then 5
    assert [(c["before"], c["after"]) for c in found["changes"]] == [("0.5.0", "0.6.0")]


def test_a_first_release_that_does_not_run_gives_way_to_the_next_that_does_below_the_grids_first_anchor():
    order = [f"0.{i}.0" for i in range(9)]
    results = {r: bad() for r in order}
    results.update({"0.0.0": SKIP, "0.1.0": GOOD})
    measure, calls = measuring(results)
    found = search.search(order, measure, stride=4, confirm=False)
    assert [(c["before"], c["after"]) for c in found["changes"]] == [("0.1.0", "0.2.0")]
    assert calls.count("0.8.0") == 1 and calls.count("0.0.0") == 1  # each release measured once


def test_a_change_says_which_way_it_goes_between_which_releases_and_whether_it_repeated():
    ch = {"before": "0.1.0", "after": "0.2.0", "between": [], "from": GOOD, "to": bad("x")}
    assert search.describe(ch) == "0.1.0 -> 0.2.0: last good 0.1.0, first bad 0.2.0: the step becomes x"
    ch = {**ch, "from": bad("y"), "to": GOOD, "confirmed": True}
    assert search.describe(ch) == "0.1.0 -> 0.2.0: last bad 0.1.0 (y), first good 0.2.0"
    ch = {**ch, "to": bad("z"), "between": ["0.1.5"], "confirmed": False}
    assert search.describe(ch) == ("between 0.1.0 and 0.2.0 (not run here: 0.1.5): the step is y until 0.1.0, z from "
                                   "0.2.0 (NOT confirmed: a second run of one side gave another result)")
    ch = {"before": "0.1.0", "after": "0.2.0", "between": [], "from": SKIP, "to": GOOD}
    assert search.describe(ch) == "0.1.0 -> 0.2.0: cannot-run until 0.1.0, not-affected from 0.2.0"
    ch = {**ch, "from": GOOD, "to": {**SKIP, "verdict": oracle.INCONCLUSIVE}}
    assert search.describe(ch) == "0.1.0 -> 0.2.0: not-affected until 0.1.0, inconclusive from 0.2.0"
    ch = {**ch, "from": {**bad("y"), "ratios": [0.227]}, "to": {**bad("y"), "ratios": [0.908]}}
    assert search.describe(ch) == ("0.1.0 -> 0.2.0: affected on both sides, but the measured step changes: ratio of "
                                   "step 1 0.227 -> 0.908")


def test_the_table_gives_each_releases_verdict_step_and_ratios_and_the_releases_not_run():
    found = {"order": ["0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"],
             "measured": {"0.1.0": {**GOOD, "ratios": [1.0, None, 0.99999]}, "0.2.0": {**bad("x"), "ratios": [1, 0.5]},
                          "0.4.0": {**SKIP, "reason": "r" * 200}, "0.5.0": {**bad(None), "ratios": []}}}
    lines = search.table(found).splitlines()
    assert lines[:2] == ["| DeepSpeed | verdict | the step is | ratio per step |", "|---|---|---|---|"]
    assert lines[2] == "| 0.1.0 | not-affected | global mean | 1.000 / 1.000 |"
    assert lines[3] == "| 0.2.0 | affected | x | 1.000 / 0.500 |"
    assert lines[4] == "| 0.3.0 | not run (no change around it) | | |"
    assert lines[5] == f"| 0.4.0 | cannot-run | skipped: {'r' * 160} | - |"
    assert lines[6] == "| 0.5.0 | affected | - | - |" and len(lines) == 7
    assert search.table({**found, "axis": "transformers"}).startswith("| transformers | verdict |")
    no_reason = search.table({"order": ["1"], "measured": {"1": {**SKIP, "reason": None}}})
    assert no_reason.splitlines()[2] == "| 1 | cannot-run | skipped:  | - |"


# ---------------------------------------------------------------------------------------------- the change

def test_the_trainers_accelerator_set_up_is_on_the_gradient_path():
    src = ("class Trainer:\n    def create_accelerator_and_postprocess(self):\n        num_steps = 1\n"
           "    def log(self):\n        pass\n")
    assert set(diff._functions(src, "Trainer")) == {"Trainer.create_accelerator_and_postprocess"}


def test_the_functions_on_the_gradient_path_keep_their_decorators_and_module_functions_are_read_without_a_class():
    src = ("import x\n\n@decorate\n@twice\ndef reduce_grads(a):\n    return helper(a)\n\n"
           "def helper(a):\n    return a\n\ndef describe():\n    pass\n\n"
           "class Engine:\n    @property\n    def is_gradient_accumulation_boundary(self):\n        return helper(1)\n"
           "    def forward(self):\n        pass\n    async def allreduce_bucket(self):\n        pass\n")
    funcs = diff._functions(src, None)
    assert set(funcs) == {"reduce_grads"}  # module-level functions on the path; a helper of none of them by name
    assert funcs["reduce_grads"].startswith("@decorate\n@twice\ndef reduce_grads(a):")
    assert funcs["reduce_grads"].endswith("    return helper(a)")
    cls = diff._functions(src, "Engine")
    assert set(cls) == {"Engine.is_gradient_accumulation_boundary", "Engine.allreduce_bucket", "helper"}
    assert cls["Engine.is_gradient_accumulation_boundary"].lstrip().startswith("@property")
    assert cls["helper"] == "def helper(a):\n    return a"
    assert diff._functions(src, "Missing") == {}
    assert diff._functions("class Step:\n    def BackWard(self):\n        pass\n", "Step") != {}  # any case


def _release(root, files: dict):
    pkg = root / "deepspeed"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_commit_of_a_release_is_read_from_its_package_and_unknown_is_none(monkeypatch, tmp_path):
    roots = {"a": _release(tmp_path / "a", {"git_version_info_installed.py": "version='1'\ngit_hash='abc123'\n"}),
             "b": _release(tmp_path / "b", {"git_version_info_installed.py": "git_hash = 'unknown'\n",
                                            "git_version_info.py": "git_hash=\"def456\"\n"}),
             "c": _release(tmp_path / "c", {"git_version_info.py": "git_hash=''\n"}), "d": None,
             "e": _release(tmp_path / "e", {"other.py": ""}),
             "f": _release(tmp_path / "f", {"git_version_info.py": "git_hash='fff'\n"})}  # only the older name
    monkeypatch.setattr(diff, "_source_root", lambda r, p=listing.PACKAGE: roots[r])
    assert [diff.git_hash(r) for r in "abcdef"] == ["abc123", "def456", None, None, None, "fff"]


def test_a_releases_source_is_its_resolved_stacks_package_folder_and_none_where_it_cannot_install(monkeypatch, tmp_path):
    asked = []

    def resolve_stack(stack, packages):
        asked.append((stack, packages))
        if stack.get("deepspeed") == "0.1.0":
            raise versions.CannotRun("no wheel")
        return SimpleNamespace(roots={"deepspeed": str(tmp_path)} if stack else {})

    monkeypatch.setattr(versions, "installed_version", lambda p: "0.18.6")
    monkeypatch.setattr(versions, "resolve_stack", resolve_stack)
    monkeypatch.setattr(versions, "module_name", lambda p: p.replace("-", "_"))
    assert diff._source_root("0.17.0") == tmp_path / "deepspeed"
    assert asked == [({"deepspeed": "0.17.0"}, ("deepspeed",))]
    assert diff._source_root("0.1.0") is None and diff._source_root("0.18.6") is None  # no root said: none
    diff._source_root("4.46.3", "transformers")  # an old transformers' source alone: no accelerate beside it
    assert asked[-1] == ({"transformers": "4.46.3"}, ("transformers",))


ENGINE_A = ("class DeepSpeedEngine:\n    def backward(self, loss):\n        return loss\n"
            "    def step(self):\n" + "".join(f"        a{i} = {i}\n" for i in range(40)) +
            "    def old_reduce(self):\n        pass\n    def forward(self):\n        return 1\n")
ENGINE_B = ("class DeepSpeedEngine:\n    def backward(self, loss):\n        return loss\n"
            "    def step(self):\n" + "".join(f"        a{i} = {i + 1}\n" for i in range(40)) +
            "    def new_boundary(self):\n        pass\n    def forward(self):\n        return 2\n")


def test_the_diff_holds_the_changed_added_and_removed_functions_on_the_path_cut_at_max_lines(monkeypatch, tmp_path):
    roots = {"0.1.0": _release(tmp_path / "a", {"runtime/engine.py": ENGINE_A,
                                                "runtime/zero/stage3.py": "class DeepSpeedZeroOptimizer_Stage3:\n"
                                                                          "    def step(self):\n        pass\n",
                                                "git_version_info_installed.py": "git_hash='aaa'\n"}),
             "0.2.0": _release(tmp_path / "b", {"runtime/engine.py": ENGINE_B,
                                                "git_version_info_installed.py": "git_hash='bbb'\n"})}
    monkeypatch.setattr(diff, "_source_root", lambda r, p=listing.PACKAGE: roots[r])
    d = diff.diff("0.1.0", "0.2.0", "DeepSpeedZeroOptimizer_Stage3", max_lines=30)
    assert (d["before"], d["after"], d["package"], d["commits"]) == ("0.1.0", "0.2.0", "deepspeed", ("aaa", "bbb"))
    opt, eng = d["files"]
    assert opt == {"file": "deepspeed/runtime/zero/stage3.py", "class": "DeepSpeedZeroOptimizer_Stage3",
                   "functions": [], "note": "not in both releases"}
    assert eng["file"] == "deepspeed/runtime/engine.py" and eng["class"] == "DeepSpeedEngine"
    funcs = {f["name"]: f for f in eng["functions"]}
    # unchanged (backward) and off the path (forward) left out; present in the newer release first, by name
    assert [f["name"] for f in eng["functions"]] == ["DeepSpeedEngine.new_boundary", "DeepSpeedEngine.step",
                                                     "DeepSpeedEngine.old_reduce"]
    assert [funcs[n]["status"] for n in funcs] == ["added", "changed", "removed"]
    step = funcs["DeepSpeedEngine.step"]
    assert step["lines"] == 80  # 40 lines out, 40 in: the file headers are not counted
    assert step["diff"].startswith("--- 0.1.0/deepspeed/runtime/engine.py\n+++ 0.2.0/deepspeed/runtime/engine.py")
    assert len(step["diff"].splitlines()) == 31 and step["diff"].endswith(f"\n... ({84 - 30} more lines)")
    assert funcs["DeepSpeedEngine.new_boundary"]["lines"] == 2 and "more lines" not in funcs[
        "DeepSpeedEngine.new_boundary"]["diff"]
    default = {f["name"]: f for f in diff.diff("0.1.0", "0.2.0", None)["files"][0]["functions"]}
    assert default["DeepSpeedEngine.step"]["diff"].endswith("\n... (24 more lines)")  # 60 lines by default
    ctx = ENGINE_A.replace("        a20 = 20\n", "        a20 = 21\n")  # one line changed: two lines around it
    roots["0.1.5"] = _release(tmp_path / "c", {"runtime/engine.py": ctx})
    one = {f["name"]: f for f in diff.diff("0.1.0", "0.1.5", None)["files"][0]["functions"]}["DeepSpeedEngine.step"]
    assert one["diff"].splitlines()[3:] == ["         a18 = 18", "         a19 = 19", "-        a20 = 20",
                                            "+        a20 = 21", "         a21 = 21", "         a22 = 22"]
    whole = diff.diff("0.1.0", "0.2.0", "DeepSpeedZeroOptimizer_Stage3", max_lines=84)  # 84 lines: all of them
    assert "more lines" not in {f["name"]: f for f in whole["files"][1]["functions"]}["DeepSpeedEngine.step"]["diff"]
    assert [f["file"] for f in diff.diff("0.1.0", "0.2.0", "SGD")["files"]] == ["deepspeed/runtime/engine.py"]
    assert [f["file"] for f in diff.diff("0.1.0", "0.2.0", None)["files"]] == ["deepspeed/runtime/engine.py"]
    roots["0.3.0"] = None  # a release whose source cannot be read: a note, not a crash
    assert diff.diff("0.1.0", "0.3.0", None)["files"][0]["note"] == "not in both releases"
    roots["0.4.0"] = _release(tmp_path / "d", {})
    assert diff.diff("0.4.0", "0.1.0", None)["files"][0]["note"] == "not in both releases"


def test_another_packages_diff_reads_its_own_files(monkeypatch, tmp_path):
    def root(r, p):
        assert p == "transformers"
        path = tmp_path / r / "transformers"
        path.mkdir(parents=True, exist_ok=True)
        (path / "trainer.py").write_text(f"class Trainer:\n    def training_step(self):\n        return {r[0]}\n")
        return path

    monkeypatch.setattr(diff, "_source_root", root)
    d = diff.diff("4.0", "5.0", "DeepSpeedZeroOptimizer", package="transformers")  # a DeepSpeed optimizer: not read
    assert [(f["file"], f["class"]) for f in d["files"]] == [("transformers/trainer.py", "Trainer")]
    assert [f["name"] for f in d["files"][0]["functions"]] == ["Trainer.training_step"]
    assert d["commits"] == (None, None)


def test_the_diff_text_names_the_commits_or_the_tags_and_shows_the_largest_changes_first():
    fn = lambda name, n: {"name": name, "status": "changed", "lines": n, "diff": f"<diff of {name}>"}  # noqa: E731
    d = {"before": "0.1.0", "after": "0.2.0", "commits": ("aaa", "bbb"),
         "files": [{"file": "deepspeed/runtime/zero/stage3.py", "class": "Z3", "functions": [], "note": "not in both"},
                   {"file": "deepspeed/runtime/engine.py", "class": "E", "functions": []},
                   {"file": "deepspeed/x.py", "class": "X", "functions": [fn("a", 2), fn("b", 9), fn("c", 5)]}]}
    lines = diff.diff_text(d, max_functions=2).splitlines()
    assert lines[0] == ("the commits between them: git log --oneline aaa..bbb -- deepspeed/runtime/zero/stage3.py "
                        "deepspeed/runtime/engine.py deepspeed/x.py")
    assert lines[1] == "deepspeed/runtime/zero/stage3.py (Z3): not in both"
    assert lines[2] == "deepspeed/runtime/engine.py (E): no function on the gradient path changed"
    assert lines[3] == ("deepspeed/x.py (X): 3 function(s) on the gradient path changed: a (changed, 2 lines), "
                        "b (changed, 9 lines), c (changed, 5 lines)")
    assert lines[4:] == ["<diff of b>", "<diff of c>"]
    assert diff.diff_text(d).splitlines()[4:] == ["<diff of b>", "<diff of c>", "<diff of a>"]
    many = {**d, "files": [{"file": "f.py", "class": "C", "functions": [fn(f"f{i}", i) for i in range(8)]}]}
    assert diff.diff_text(many).splitlines()[2:] == [f"<diff of f{i}>" for i in (7, 6, 5, 4, 3, 2)]  # six at most
    for commits in ((None, "bbb"), ("aaa", None)):
        head = diff.diff_text({**d, "commits": commits}).splitlines()[0]
        assert head.startswith("the commits between them (the packages name no commit: their release tags): "
                               "git log --oneline v0.1.0..v0.2.0 -- ")


# ---------------------------------------------------------------------------------------------- the command

@pytest.fixture
def command(monkeypatch, tmp_path):
    """``gradkit bisect`` on a real config file with the measure, the install and the diff replaced."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}))
    state = {"results": {}, "prefetched": [], "problems": [], "made": []}

    def measure_with(c, loop, world_size, device, timeout_s, steps, model, fixed=None):
        state["made"].append((loop, world_size, device, timeout_s, steps) + ((fixed,) if fixed else ()))
        return measuring(state["results"])[0]

    monkeypatch.setattr(result, "measure_with", measure_with)
    monkeypatch.setattr(search, "prefetch", lambda order, stride, progress, probe, axis, fixed: state["prefetched"].append(
        (order, stride, progress, probe, axis) + ((fixed,) if fixed else ())) or state["problems"])
    monkeypatch.setattr(diff, "diff", lambda b, a, opt, package: {
        "before": b, "after": a, "commits": ("c1", "c2"), "optimizer": opt,
        "files": [{"file": "deepspeed/runtime/engine.py", "class": "E", "functions": []}]})
    return cfg, state


def test_the_command_prints_the_search_the_table_and_each_change_with_its_code_and_exits_by_the_newest(command, capsys,
                                                                                                          tmp_path):
    cfg, state = command
    state["results"] = {"0.1.0": {**bad("x"), "optimizer": "Z"}, "0.2.0": {**GOOD, "optimizer": None},
                        "0.3.0": SKIP}
    state["problems"] = ["0.3.0: does not install"]
    out = tmp_path / "found.json"
    code = bisect.main([str(cfg), "--loop", "manual", "--releases", "0.1.0,0.2.0,0.3.0", "--stride", "2", "--json",
                        str(out), "--no-progress", "--steps", "2", "--timeout", "90"])
    text = capsys.readouterr().out
    assert code == 0  # the newest release that ran (0.2.0) is not affected; 0.3.0 did not run
    assert text.startswith(f"gradkit bisect {cfg}: loop manual, 2 judged steps each; 3 deepspeed releases from "
                           "--releases (0.1.0 .. 0.3.0), every 2 releases first\n")
    assert "  not prepared: 0.3.0: does not install\n" in text
    assert "     0.1.0: affected (x)\n" in text and "     0.3.0: cannot-run (does not install here)\n" in text
    assert "     0.2.0: not-affected\n" in text
    assert "| 0.2.0 | not-affected | global mean | 1.000 |" in text
    assert "(a change and its undoing between two of the first pass's releases, 2 apart, is not seen" in text
    assert "change: 0.1.0 -> 0.2.0: last bad 0.1.0 (x), first good 0.2.0\n" in text
    assert "    the commits between them: git log --oneline c1..c2 -- deepspeed/runtime/engine.py\n" in text
    assert text.rstrip().endswith("newest release that ran: 0.2.0, not-affected")
    assert state["prefetched"] == [(["0.1.0", "0.2.0", "0.3.0"], 2, False, None, "deepspeed")]
    assert state["made"] == [("manual", 2, "cpu", 90.0, 2)]
    doc = json.loads(out.read_text())
    assert (doc["config"], doc["probe"], doc["axis"], doc["loop"], doc["releases_from"]) == (str(cfg), None, "deepspeed",
                                                                                             "manual", "--releases")
    assert doc["changes"][0]["diff"]["optimizer"] == "Z" and doc["changes"][0]["confirmed"] is True
    assert "axis" not in doc["measured"] and doc["order"] == ["0.1.0", "0.2.0", "0.3.0"]


def test_the_command_exits_1_when_the_newest_release_that_ran_is_affected_and_3_when_fewer_than_two_ran(command, capsys):
    cfg, state = command
    state["results"] = {"0.1.0": GOOD, "0.2.0": {**bad("y"), "optimizer": None}}
    assert bisect.main([str(cfg), "--releases", "0.1.0,0.2.0", "--stride", "1", "--no-confirm"]) == 1
    text = capsys.readouterr().out
    assert "newest release that ran: 0.2.0, affected" in text and "is not seen" not in text  # stride 1: all seen
    assert "change: 0.1.0 -> 0.2.0: last good 0.1.0, first bad 0.2.0: the step becomes y\n" in text
    state["results"] = {"0.1.0": GOOD, "0.2.0": GOOD}
    assert bisect.main([str(cfg), "--releases", "0.1.0,0.2.0"]) == 0
    assert "no change: every release that ran gave the same result" in capsys.readouterr().out
    state["results"] = {"0.1.0": GOOD, "0.2.0": SKIP}
    assert bisect.main([str(cfg), "--releases", "0.1.0,0.2.0"]) == 3
    text = capsys.readouterr().out
    assert "nothing to compare: fewer than two releases ran here" in text and "newest release" not in text
    state["results"] = {"0.1.0": SKIP, "0.2.0": SKIP}
    assert bisect.main([str(cfg), "--releases", "0.1.0,0.2.0"]) == 3
    state["results"] = {"0.1.0": GOOD, "0.2.0": bad(), "0.3.0": GOOD}  # the newest of three decides
    assert bisect.main([str(cfg), "--releases", "0.1.0,0.2.0,0.3.0", "--stride", "1"]) == 0
    assert "newest release that ran: 0.3.0, not-affected" in capsys.readouterr().out


def test_the_command_says_how_the_config_was_read_and_cuts_a_reason_at_120_characters(command, capsys, tmp_path,
                                                                                      monkeypatch):
    from gradkit.probes import ds_config

    cfg, state = command
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}))
    seen, real = [], ds_config.resolve
    monkeypatch.setattr(ds_config, "resolve", lambda user, w, ga, dtype: seen.append((w, ga, dtype))
                        or real(user, w, ga, dtype))
    state["results"] = {"0.1.0": {**SKIP, "reason": "why " + "x" * 200}, "0.2.0": GOOD, "0.3.0": GOOD}
    assert bisect.main([str(auto), "--releases", "0.1.0,0.2.0,0.3.0"]) == 0
    text = capsys.readouterr().out
    assert seen == [(2, 4, "fp32")]  # "auto" GA is 4 unless --ga says otherwise
    assert "  as run: gradient_accumulation_steps auto -> 4\n" in text
    assert f"     0.1.0: cannot-run ({('why ' + 'x' * 200)[:120]})\n" in text
    assert "every 4 releases first" in text and "releases, 4 apart, is not seen" in text  # the default stride
    assert bisect.parser().description.startswith("``gradkit bisect ds_config.json``: since which DeepSpeed release")
    assert bisect.parser().description == bisect.__doc__.split("\n\n")[0]


def test_the_command_refuses_bad_numbers_and_a_missing_json_folder_before_anything_runs(command, tmp_path):
    cfg, state = command
    for args, match in ((["--stride", "0"], "--stride"), (["--steps", "0"], "--steps"), (["--device", "tpu"], "device"),
                        (["--timeout", "0"], "timeout"), (["--world-size", "0"], "world"),
                        (["--json", str(tmp_path / "no" / "x.json")], "does not exist")):
        with pytest.raises(kconfig.ConfigError, match=match):
            bisect.main([str(cfg), "--releases", "0.1.0,0.2.0", *args])
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                                "bf16": {"enabled": "auto"}}))
    with pytest.raises(kconfig.ConfigError, match="say which with --trainer-dtype"):
        bisect.main([str(auto), "--releases", "0.1.0,0.2.0"])
    for axis in ("torch", "transformers"):
        with pytest.raises(kconfig.ConfigError, match=rf"--axis {axis}: the B4 probe's stack names \['deepspeed'\] "
                                                      r"\(torch is the installed one\)"):
            bisect.main(["--probe", "B4", "--axis", axis, "--releases", "0.1.0,0.2.0"])
    with pytest.raises(kconfig.ConfigError, match="one of the three"):
        bisect.main(["--releases", "0.1.0,0.2.0"])
    with pytest.raises(kconfig.ConfigError, match="one of the three"):
        bisect.main([str(cfg), "--known", "B5", "--releases", "0.1.0,0.2.0"])
    for given, match in ((["--with", "torch=2.0.0"], "PACKAGE one of deepspeed, transformers, accelerate"),
                         (["--with", "transformers"], "give PACKAGE=RELEASE"),
                         (["--with", "deepspeed=0.18.6"], "deepspeed is the axis being bisected"),
                         (["--with", "transformers=latest"], "release number"),
                         (["--case", "trainer"], "--case needs --probe")):
        with pytest.raises(kconfig.ConfigError, match=match):
            bisect.main([str(cfg), "--releases", "0.1.0,0.2.0", *given])
    with pytest.raises(kconfig.ConfigError, match="--known 'B99': the recipes are B1, B1 on DeepSpeed"):
        bisect.main(["--known", "B99", "--releases", "0.1.0,0.2.0"])
    for extra in (["--with", "transformers=5.3.0"], ["--case", "x"], ["--model", "conditional"],
                  ["--axis", "accelerate"]):
        with pytest.raises(kconfig.ConfigError, match="--known takes its axis, case, model and held releases"):
            bisect.main(["--known", "B5", "--releases", "0.1.0,0.2.0", *extra])
    assert state["made"] == [] and state["prefetched"] == []


def test_a_probe_is_bisected_with_its_quick_plan_on_its_measured_case_over_the_axis_given(command, monkeypatch, capsys,
                                                                                         tmp_path):
    from gradkit import probes

    cfg, state = command
    probe = probes.get("B1")
    made = []
    monkeypatch.setattr(result, "probe_measure", lambda p, kw, case, axis, fixed: made.append((p.id, kw, case, axis))
                        or measuring({"4.46.0": bad("z"), "5.3.0": GOOD})[0])
    out = tmp_path / "b1.json"
    code = bisect.main(["--probe", "B1", "--axis", "transformers", "--releases", "4.46.0,5.3.0", "--json", str(out),
                        "--timeout", "77"])
    text = capsys.readouterr().out
    assert code == 0 and made == [("B1", {**probe.quick_plan(2), "device": "cpu", "timeout_s": 77.0},
                                   probe.measured_case, "transformers")]
    assert text.startswith(f"gradkit bisect the B1 probe ({probe.title}), case {probe.measured_case}; 2 transformers "
                           "releases from --releases")
    assert "| transformers | verdict |" in text
    assert state["prefetched"] == [(["4.46.0", "5.3.0"], search.STRIDE, True, probe, "transformers")]
    assert json.loads(out.read_text())["axis"] == "transformers"


def test_another_package_is_held_at_one_release_and_a_probes_case_is_chosen(command, monkeypatch, capsys):
    from gradkit import probes

    cfg, state = command
    made = []
    monkeypatch.setattr(result, "probe_measure", lambda p, kw, case, axis, fixed: made.append((p.id, case, axis, fixed))
                        or measuring({"0.18.6": bad("z"), "0.19.0": bad("z")})[0])
    code = bisect.main(["--probe", "B1", "--axis", "deepspeed", "--with", "transformers=5.3.0", "--case", "gas1",
                        "--releases", "0.18.6,0.19.0", "--no-progress"])
    text = capsys.readouterr().out
    assert code == 1 and made == [("B1", "gas1", "deepspeed", {"transformers": "5.3.0"})]
    assert "  as run: transformers 5.3.0 in every stack\n" in text and ", case gas1;" in text
    assert state["prefetched"][-1] == (["0.18.6", "0.19.0"], search.STRIDE, False, probes.get("B1"), "deepspeed",
                                       {"transformers": "5.3.0"})
    # a config too: the held release goes into every world's stack
    state["results"] = {"0.1.0": GOOD, "0.2.0": GOOD}
    assert bisect.main([str(cfg), "--releases", "0.1.0,0.2.0", "--with", "accelerate=1.0.1", "--no-progress"]) == 0
    assert state["made"][-1][-1] == {"accelerate": "1.0.1"}


def test_a_known_bug_is_bisected_by_its_recipe_from_its_oldest_release(command, monkeypatch, capsys, tmp_path):
    cfg, state = command
    made = []
    monkeypatch.setattr(known, "measure", lambda r, *a: made.append((r.name, a)) or measuring({"0.14.4": GOOD,
                                                                                               "0.15.2": bad("z")})[0])
    monkeypatch.setattr(listing, "index_releases", lambda p=listing.PACKAGE: (["0.14.0", "0.14.4", "0.15.2"], "idx"))
    monkeypatch.setattr(versions, "installed_version", lambda p: "0.15.2")
    out = tmp_path / "b5.json"
    assert bisect.main(["--known", "B5", "--no-progress", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert made == [("B5", (2, "cpu", 300.0, bisect.ds_config.STEPS))]
    assert text.startswith("gradkit bisect the known bug B5 (loop engine); 2 deepspeed releases from idx (0.14.4 .. ")
    assert f"  as run: releases older than 0.14.4: {known.RECIPES['B5'].older}\n" in text
    assert "last good 0.14.4, first bad 0.15.2" in text
    doc = json.loads(out.read_text())
    assert doc["known"] == "B5" and doc["loop"] == "engine" and doc["with"] == {}
    made.clear()
    monkeypatch.setattr(listing, "index_releases", lambda p=listing.PACKAGE: (["5.3.0", "5.4.0"], "idx"))
    assert bisect.main(["--known", "B1 on DeepSpeed", "--releases", "0.14.4,0.15.2", "--no-progress"]) == 1
    assert "  as run: transformers 5.3.0 in every stack" in capsys.readouterr().out
    assert state["prefetched"][-1][-1] == {"transformers": "5.3.0"} and state["prefetched"][-1][4] == "deepspeed"


def test_a_known_bugs_bisect_keeps_what_it_measured_in_the_release_history_when_asked(command, monkeypatch, capsys,
                                                                                       tmp_path):
    from gradkit.judge import history

    cfg, state = command
    monkeypatch.setattr(history, "PATH", tmp_path / "history.json")
    monkeypatch.setattr(known, "measure", lambda r, *a: measuring({"0.14.4": GOOD, "0.15.2": bad("z")})[0])
    assert bisect.main(["--known", "B5", "--releases", "0.14.4,0.15.2", "--no-progress", "--keep"]) == 1
    text = capsys.readouterr().out
    h = history.load(tmp_path / "history.json")
    assert list(h["series"]["B5"]["releases"]) == ["0.14.4", "0.15.2"] and f"kept: 2 releases in {tmp_path}" in text
    assert h["series"]["B5"]["releases"]["0.15.2"]["by"] == "gradkit bisect --known B5 --releases 0.14.4,0.15.2 " \
                                                             "--no-progress --keep"
    monkeypatch.setattr(known, "measure", lambda r, *a: measuring({"0.14.4": bad("z"), "0.15.2": bad("z")})[0])
    bisect.main(["--known", "B5", "--releases", "0.14.4,0.15.2", "--no-progress", "--keep"])
    assert "moved: B5 on deepspeed 0.14.4: was not-affected" in capsys.readouterr().out
    bisect.main(["--known", "B5", "--releases", "0.14.4,0.15.2", "--no-progress"])  # not asked: nothing kept
    assert "kept" not in capsys.readouterr().out
    with pytest.raises(kconfig.ConfigError, match="--keep needs --known"):
        bisect.main([str(cfg), "--releases", "0.1.0,0.2.0", "--keep"])


class _Pipe:
    """A stdout that keeps what was written and how much of it was flushed: what a reader at the other end of a pipe
    (``gradkit bisect ... | tee log``) has seen."""

    def __init__(self):
        self.written, self.flushed = "", ""

    def write(self, s):
        self.written += s
        return len(s)

    def flush(self):
        self.flushed = self.written


def test_each_releases_line_reaches_the_reader_before_the_next_release_is_measured(command, monkeypatch):
    import sys

    cfg, state = command
    pipe, seen = _Pipe(), []
    measure, _ = measuring({"0.1.0": GOOD, "0.2.0": bad("x"), "0.3.0": bad("x")})

    def measure_with(*a, **k):
        return lambda release: seen.append((release, pipe.flushed)) or measure(release)

    monkeypatch.setattr(result, "measure_with", measure_with)
    monkeypatch.setattr(sys, "stdout", pipe)
    code = bisect.main([str(cfg), "--releases", "0.1.0,0.2.0,0.3.0", "--stride", "1", "--no-confirm", "--no-progress"])
    assert code == 1 and [r for r, _ in seen] == ["0.1.0", "0.2.0", "0.3.0"]
    assert seen[1][1].endswith("     0.1.0: not-affected\n") and seen[2][1].endswith("     0.2.0: affected (x)\n")
    assert "     0.3.0: affected (x)\n" in pipe.flushed


def test_the_json_file_is_indented_one_space_a_level(command, tmp_path):
    cfg, state = command
    state["results"] = {"0.1.0": GOOD, "0.2.0": {**bad("y"), "optimizer": None}}
    out = tmp_path / "found.json"
    bisect.main([str(cfg), "--releases", "0.1.0,0.2.0", "--json", str(out), "--no-progress"])
    text = out.read_text()
    assert text == json.dumps(json.loads(text), indent=1)
    assert text.startswith('{\n "config": ') and '\n  "0.1.0": {\n   "release": "0.1.0",\n' in text


def test_run_as_a_module_the_release_history_says_the_command_from_its_own_arguments(command, monkeypatch, capsys,
                                                                                       tmp_path):
    """``python -m gradkit.commands.bisect ...`` gives main no arguments: they are sys.argv's after the script's
    path."""
    import sys

    from gradkit.judge import history

    monkeypatch.setattr(history, "PATH", tmp_path / "history.json")
    monkeypatch.setattr(known, "measure", lambda r, *a: measuring({"0.14.4": GOOD, "0.15.2": bad("z")})[0])
    monkeypatch.setattr(sys, "argv", ["/somewhere/kit/commands/bisect/__main__.py", "--known", "B5", "--releases",
                                      "0.14.4,0.15.2", "--no-progress", "--keep"])
    assert bisect.main() == 1
    h = history.load(tmp_path / "history.json")
    assert h["series"]["B5"]["releases"]["0.14.4"]["by"] == "gradkit bisect --known B5 --releases 0.14.4,0.15.2 " \
                                                             "--no-progress --keep"
