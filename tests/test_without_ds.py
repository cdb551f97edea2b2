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


def _params(**kw):
    from kit import runall

    return {**runall.notebook_defaults(runall.NOTEBOOKS / "07_without_deepspeed.ipynb"), **kw}


def test_notebook_07s_parameters_are_checked_and_name_every_stack_its_worlds_run():
    import pytest

    from kit import config as kconfig

    pairs = without_ds.check_notebook(_params(ACCELERATE_VERSIONS=["installed", "0.30.1"],
                                              TRAINER_STACKS=["installed", "transformers 4.45.2"]))
    assert [(p.id, s) for p, s in pairs] == [("DDP", {}), ("FSDP2", {}), ("ACC", {}), ("ACC", {"accelerate": "0.30.1"}),
                                             ("HFT", {}), ("HFT", {"transformers": "4.45.2", "accelerate": "1.0.1"})]
    for bad, said in ((dict(TRAINER_STACKS=["transformers 9"]), "TRAINER_STACKS: unknown"),
                      (dict(TRAINER_WORLD_SIZES=[1]), "on several ranks"), (dict(TRAINER_GAS=[1]), "each > 1"),
                      (dict(FSDP2_SETTINGS=["fp8"]), "unknown FSDP2 setting"),
                      (dict(ACCELERATE_VERSIONS=["latest"]), "latest"), (dict(GA_VALUES=[]), "GA_VALUES")):
        with pytest.raises(kconfig.ConfigError, match=said):
            without_ds.check_notebook(_params(**bad))


def test_a_cell_is_named_by_its_path_case_setting_and_the_release_of_the_package_that_decides_it():
    fsdp = {**_rec("FSDP2", "sync_last", oracle.NOT_AFFECTED, "2.13.0+cpu"), "setting": "bf16 / fp32 reduce"}
    acc = _rec("ACC", "accumulate", oracle.NOT_AFFECTED, "0.30.1")
    hft = _rec("HFT", "trainer", oracle.AFFECTED, "4.45.2", 1.003)
    assert [without_ds.release(r) for r in (fsdp, acc, hft)] == ["torch 2.13.0+cpu", "accelerate 0.30.1",
                                                                "transformers 4.45.2"]
    assert without_ds.row_key(fsdp) == "FSDP2 · sync_last [bf16 / fp32 reduce]"
    assert without_ds.row_key({**acc, "setting": "accelerate 0.30.1"}) == "ACC · accumulate"  # the column says it
    newer = _rec("ACC", "accumulate", oracle.NOT_AFFECTED, "1.15.0")
    assert [r["bug"] + " " + without_ds.release(r) for r in without_ds.in_matrix_order([hft, newer, acc, fsdp])] == \
        ["FSDP2 torch 2.13.0+cpu", "ACC accelerate 0.30.1", "ACC accelerate 1.15.0", "HFT transformers 4.45.2"]
    table = without_ds.markdown(without_ds.matrix_rows([fsdp, hft]))
    assert "| FSDP2 | sync_last [bf16 / fp32 reduce] | torch 2.13.0+cpu | not-affected | 1.0000 |" in table
    assert "| HFT | trainer | transformers 4.45.2 | affected | 1.0030 |" in table


def test_the_notebooks_assertions_name_a_missing_path_and_a_pinned_release_that_disagrees():
    recs = [_rec("ACC", "sync_each_batch", oracle.NOT_AFFECTED, "0.30.1", ga=4)]
    said = without_ds.violations(recs)
    assert "DDP: no records" in said and "FSDP2: no records" in said and "HFT: no records" in said
    assert any("ACC on accelerate 0.30.1, case sync_each_batch, ga 4: measured not-affected, but upstream says "
               "affected" in s for s in said)
    newer = [_rec("ACC", "accumulate", oracle.NOT_AFFECTED, "9.0.0")]
    assert any("newer than the table" in f for f in without_ds.findings(newer))
