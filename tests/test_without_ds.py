"""Notebook 07's logic on hand-made records: the matrix, the fixes, the overview's column, the upstream rules."""
from kit import expectations, oracle, overview, without_ds
from kit.records import NO_DEEPSPEED


def _rec(bug, case, verdict, release, ratio=1.0, role="measured", **kw):
    package = {"ACC": "accelerate", "HFT": "transformers"}.get(bug, "torch")
    versions = {"torch": "2.13.0+cpu", package: release}
    stack = {} if release in ("1.15.0", "5.23.0", "2.13.0+cpu") else {package: release}
    return {"bug": bug, "case": case, "role": role, "verdict": verdict, "versions": versions, "stack": stack,
            "version": "installed" if not stack else f"{package}={release}", "init": "torch", "world_size": 2,
            "ga": kw.pop("ga", 4), "dtype": "fp32", "model": "mlp", "config": {"model": "mlp"}, "reason": "r",
            "metrics": None if verdict == oracle.CANNOT_RUN else {"norm_ratio": ratio, "cosine": 1.0}, **kw}


def test_the_matrix_takes_the_worst_verdict_of_a_cell_and_keeps_releases_apart():
    recs = [_rec("ACC", "sync_each_batch", oracle.NOT_AFFECTED, "1.15.0"),
            _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.98),
            _rec("ACC", "sync_each_batch", oracle.NOT_AFFECTED, "0.30.1", ga=1)]
    rows = {(r["case"], r["release"]): r for r in without_ds.matrix_rows(recs)}
    assert rows[("sync_each_batch", "accelerate 0.30.1")]["verdict"] == oracle.AFFECTED
    assert rows[("sync_each_batch", "accelerate 0.30.1")]["configs"] == 2
    assert rows[("sync_each_batch", "accelerate 1.15.0")]["verdict"] == oracle.NOT_AFFECTED


def test_a_fix_is_found_on_a_newer_release_and_judged_against_the_table():
    recs = [_rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.98),
            _rec("ACC", "sync_each_batch", oracle.NOT_AFFECTED, "0.31.0")]
    (fix,) = without_ds.fixes(recs)
    assert fix["problem"] == "ACC · sync_each_batch on accelerate 0.30.1" and fix["fix_release"] == "accelerate 0.31.0"
    assert fix["after"] == fix["expected_after"] == oracle.NOT_AFFECTED
    broken = [recs[0], _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.31.0", 0.98)]
    (fix,) = without_ds.fixes(broken)  # a "fix" that does not fix is reported as what it measured
    assert fix["after"] == oracle.AFFECTED and fix["expected_after"] == oracle.NOT_AFFECTED
    assert without_ds.fixes([recs[0]]) == []  # no newer release ran: nothing claimed


def test_the_upstream_rules_pin_cases_releases_and_the_smallest_ga():
    acc = {"accelerate": "0.30.1"}
    assert expectations.expected("ACC", acc, case="sync_each_batch", ga=4) == oracle.AFFECTED
    assert expectations.expected("ACC", acc, case="sync_each_batch", ga=1) == oracle.NOT_AFFECTED
    assert expectations.expected("ACC", {"accelerate": "0.31.0"}, case="sync_each_batch", ga=4) == oracle.NOT_AFFECTED
    assert expectations.expected("ACC", {"accelerate": "9.0.0"}, case="accumulate", ga=4) is None  # newer: a finding
    assert expectations.expected("FSDP2", {"torch": "2.13.0+cpu"}, case="sum_not_mean", ga=1) == oracle.NOT_AFFECTED
    assert expectations.expected("HFT", {"transformers": "5.10.0"}, case="trainer", ga=4) is None  # not pinned between
    bad, _ = expectations.mismatches("ACC", [_rec("ACC", "sync_each_batch", oracle.NOT_AFFECTED, "0.30.1")])
    assert len(bad) == 1 and "upstream says affected" in bad[0]


def test_the_overview_shows_a_path_without_deepspeed_on_the_installed_stack_only():
    recs = [_rec("ACC", "accumulate", oracle.NOT_AFFECTED, "1.15.0"),
            _rec("ACC", "accumulate", oracle.AFFECTED, "0.30.1", 0.5)]
    (cell,) = [c for c in overview.verdict_matrix(recs) if c["bug"] == "ACC"]
    assert cell["deepspeed"] == NO_DEEPSPEED and cell["verdict"] == oracle.NOT_AFFECTED and cell["configs"] == 1


def test_a_mechanism_is_shown_for_the_cells_it_explains_only():
    raised = _rec("FSDP2", "sync_last", oracle.CANNOT_RUN, "2.13.0+cpu",
                  error="AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got {bf16, fp32}")
    found = without_ds.mechanisms([raised])
    assert [m["cell"] for m in found] == ["FSDP2 · sync_last on torch 2.13.0+cpu"]
    assert "pytorch/pytorch#196996" in found[0]["sentence"] and ">>" in found[0]["code"]
    assert without_ds.mechanisms([_rec("FSDP2", "sync_last", oracle.NOT_AFFECTED, "2.13.0+cpu")]) == []
