"""The verdict matrix from records: worst verdict wins, the number shown is the telling one, checks that can fail."""
import pytest

from gradkit import probes
from gradkit.judge import records
from gradkit.notebooks import overview
from gradkit.stacks import versions

DS = versions.installed_version("deepspeed")


def rec(bug, case, verdict, ratio, ga=4, dtype="fp32", ds=DS, role="measured", **kw):
    return {"bug": bug, "case": case, "role": role, "verdict": verdict, "ga": ga, "dtype": dtype, "world_size": 2,
            "zero_stage": 1, "version": "installed", "versions": {"deepspeed": ds, "transformers": "5.23.0"},
            "metrics": {"norm_ratio": ratio, "cosine": 0.9} if ratio else None, "reason": f"{verdict} because", **kw}


def test_worst_verdict_wins_and_a_crash_is_never_a_pass():
    cells = overview.verdict_matrix([
        rec("B3", "manual", "not-affected", 1.0, ga=2), rec("B3", "manual", "affected", 0.403, ga=4),
        rec("B3", "manual", "affected", 0.27, ga=8, dtype="bf16"), rec("B3", "control", "not-affected", 1.0, role="control"),
        rec("B4", "leak", "not-affected", 1.0), rec("B4", "leak", "cannot-run", None, ga=8),
    ])
    b3, b4 = cells
    assert (b3["bug"], b3["verdict"], b3["configs"], b3["configs_with_verdict"]) == ("B3", "affected", 3, 2)
    assert b3["ratio"] == 0.403 and "GA 4" in b3["where"]  # fp32 before bf16: no rounding noise in the number
    # what was judged, and beside it what could not run: never a clean bill for the whole version
    assert b4["verdict"] == "not-affected" and b4["cannot_run"] == 1 and b4["configs_with_verdict"] == 1
    assert overview.cell_text(b4).endswith("; 1 of 2 could not run")
    advice = overview.what_to_do(cells, DS)[list(probes.registry()).index("B4")]
    assert "1 more could not run" in advice and "nothing to change" not in advice
    only = overview.verdict_matrix([rec("B4", "leak", "cannot-run", None, ga=8)])[0]
    assert only["verdict"] == "cannot-run" and only["ratio"] is None and overview.unrun_text(only) == ""


def test_each_bug_shows_its_telling_number():
    stages = [{"metrics": {"norm_ratio": 1.0}}, {"metrics": {"norm_ratio": 0.125}}]
    b2 = rec("B2", "pipeline", "affected", 0.97, stages=stages)  # the whole-model ratio hides the stage's 1/GA
    b1 = rec("B1", "trainer", "affected", 0.22, gas_verdict="affected", ratio_vs_control=0.25, path="ds_zero2")
    c2, c1 = sorted(overview.verdict_matrix([b2, b1]), key=lambda c: c["bug"], reverse=True)
    assert c2["ratio"] == 0.125
    assert (c1["verdict"], c1["ratio"], c1["transformers"]) == ("affected", 0.22, "5.23.0")  # against the reference
    assert "transformers 5.23.0" in overview.matrix_table([c1]) and "GAS changes the step (x0.250" in overview.cell_text(c1)


def test_b1_says_what_is_measured_and_keeps_its_no_deepspeed_path_out_of_deepspeed_columns():
    """transformers 5.3.0: the DeepSpeed path is GAS-invariant yet 0.889 x the reference; the Trainer alone
    is what GAS changes. Neither may read 'nothing to change', and no-DS steps are not DeepSpeed's."""
    ds = rec("B1", "trainer", "affected", 0.889, gas_verdict="not-affected", ratio_vs_control=1.0, path="ds_zero0")
    ds["metrics"]["cosine"] = 1.0
    no_ds = rec("B1", "trainer", "affected", 0.222, gas_verdict="affected", ratio_vs_control=0.25, path="no_ds")
    cells = overview.verdict_matrix([ds, no_ds])
    by_col = {c["deepspeed"]: c for c in cells}
    assert set(by_col) == {DS, overview.NO_DEEPSPEED}
    assert by_col[DS]["ratio"] == 0.889 and by_col[DS]["verdict"] == "affected"  # the number shown is vs the reference
    assert "GAS-invariant" in overview.cell_text(by_col[DS])
    assert by_col[overview.NO_DEEPSPEED]["ratio"] == 0.222
    advice = overview.what_to_do(cells, DS)[0]
    assert "nothing to change" not in advice and "**affected**" in advice and "0.889" in advice
    assert "| no DeepSpeed |" in overview.matrix_table(cells).splitlines()[0] + "|"
    assert overview.violations(cells) == []


def test_what_to_do_names_the_fix_only_where_affected():
    cells = overview.verdict_matrix([rec("B3", "manual", "affected", 0.403), rec("B4", "leak", "not-affected", 1.0)])
    advice = dict(zip(probes.registry(), overview.what_to_do(cells, DS)))
    assert "set_gradient_accumulation_boundary" in advice["B3"] and "**affected**" in advice["B3"]
    assert "nothing to change" in advice["B4"]
    assert "not measured" in advice["B1"] and "01_trainer_loss_kwargs" in advice["B1"]


def test_violations_catch_a_matrix_that_cannot_be_trusted():
    good = overview.verdict_matrix([rec("B3", "manual", "affected", 0.403), rec("B4", "leak", "not-affected", 1.0)])
    assert overview.violations(good, ["B3", "B4"], ["installed"]) == []
    assert overview.violations(good, ["B2"], ["installed"]) == [f"B2 has no verdict on DeepSpeed {DS}"]
    odd = overview.verdict_matrix([rec("B4", "leak", "not-affected", 1.2), rec("B3", "manual", "affected", 1.0)])
    odd[0]["cosine"] = 1.0  # B3 (cells are sorted by bug): a perfect gradient called affected
    problems = overview.violations(odd)
    assert any("not-affected but the ratio is 1.2" in p for p in problems)
    assert any("affected but ratio 1.0" in p for p in problems)


def test_differences_between_runs():
    a = overview.verdict_matrix([rec("B3", "manual", "affected", 0.4)])
    b = overview.verdict_matrix([rec("B3", "manual", "not-affected", 1.0), rec("B4", "leak", "affected", 1.1)])
    assert overview.differences(a, a) == []
    assert overview.differences(a, b) == [f"B3 on {DS}: affected -> not-affected", f"B4 on {DS}: absent -> affected"]


def test_loading_from_a_folder_without_records_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="gradkit.notebooks.runall"):
        overview.load_results(tmp_path)


def _run_folder(folder, statuses, recs_by_stem):
    import json
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps({"run_id": "R2", "notebooks": statuses}))
    for stem, recs in recs_by_stem.items():
        records.save(recs, folder / f"{stem}.jsonl")


def test_the_overview_reads_only_this_runs_records_of_notebooks_that_finished(tmp_path):
    b4_now, b4_before = rec("B4", "leak", "affected", 1.09, run_id="R2"), rec("B4", "leak", "not-affected", 1.0, run_id="R1")
    b3_failed = rec("B3", "manual", "affected", 0.4, run_id="R2")
    _run_folder(tmp_path, {"04_bf16_leak.ipynb": "ok", "03_zero_boundary.ipynb": "failed"},
                {"04_bf16_leak": [b4_now, b4_before], "03_zero_boundary": [b3_failed]})
    recs, used = overview.load_results(tmp_path)
    assert recs == [b4_now]  # an older run's record in the same file, and a failed notebook's, never reach the matrix
    assert any("03_zero_boundary: not used (failed" in u for u in used)
    assert any("04_bf16_leak: 1 records of run R2" in u for u in used)
    _run_folder(tmp_path, {"04_bf16_leak.ipynb": "timeout"}, {})
    with pytest.raises(FileNotFoundError, match="04_bf16_leak: not used"):
        overview.load_results(tmp_path)


def test_a_relative_results_folder_is_the_repositorys_whatever_the_working_directory(tmp_path, monkeypatch):
    import os
    from gradkit import config
    folder = tmp_path / "runs" / "latest"
    _run_folder(folder, {"04_bf16_leak.ipynb": "ok"}, {"04_bf16_leak": [rec("B4", "leak", "affected", 1.09, run_id="R2")]})
    relative = os.path.relpath(folder, config.REPO_ROOT)
    monkeypatch.chdir(tmp_path)  # a kernel started elsewhere (JupyterLab: notebooks/)
    assert len(overview.load_results(relative)[0]) == 1
    with pytest.raises(FileNotFoundError) as e:
        overview.load_results("runs/no-such-run")
    assert str(config.REPO_ROOT / "runs" / "no-such-run") in str(e.value)


def test_run_probes_refuses_bad_input_before_launching():
    from gradkit import config
    with pytest.raises(config.ConfigError, match="unknown bug"):
        overview.run_probes(bugs=["B7"])
    with pytest.raises(config.ConfigError, match="version"):
        overview.run_probes(versions=["latest"])


def test_b3_cells_honour_the_n1_control_of_the_same_configuration():
    """ZeRO-0 bf16 on DeepSpeed 0.18.4 is off even at N = 1: B3 cannot be judged there (notebook 03's rule)."""
    from gradkit.probes import zero_boundary as zb

    def b3(verdict, ratio, n, dtype="bf16", stage=0):
        return rec("B3", "manual", verdict, ratio, ga=n, dtype=dtype, zero_stage=stage, reason=f"N={n} {verdict}")

    recs = zb.annotate_configs([b3("affected", 1 / 65536, 1), b3("affected", 1 / 65536, 4),
                                b3("not-affected", 1.0, 1, "fp32"), b3("not-affected", 1.0, 4, "fp32")])
    assert [r["config_verdict"] for r in recs] == ["inconclusive", "inconclusive", "not-affected", "not-affected"]
    cell, = overview.verdict_matrix(recs)
    assert cell["verdict"] == "inconclusive" and "even N=1" in cell["reason"]
    # an N = 1 that is right leaves the N > 1 verdict standing
    cell, = overview.verdict_matrix(zb.annotate_configs([b3("not-affected", 1.0, 1), b3("affected", 0.4, 4)]))
    assert cell["verdict"] == "affected" and cell["ratio"] == 0.4
