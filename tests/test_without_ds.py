"""Notebook 07's logic on hand-made records: the matrix, the fixes, the overview's column, the upstream rules."""
from gradkit.commands import check_paths
from gradkit.judge import expectations, oracle
from gradkit.notebooks import overview, runall_params, without_ds
from gradkit.judge.records import NO_DEEPSPEED


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
    assert expectations.expected("HFT", {"transformers": "5.9.0"}, case="trainer", ga=4) == oracle.AFFECTED  # pinned:
    assert expectations.expected("HFT", {"transformers": "5.10.1"}, case="trainer", ga=4) == oracle.NOT_AFFECTED  # the fix
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
    return {**runall_params.notebook_defaults(runall_params.NOTEBOOKS / "07_without_deepspeed.ipynb"), **kw}


def test_notebook_07s_parameters_are_checked_and_name_every_stack_its_worlds_run():
    import pytest

    from gradkit import config as kconfig

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


# ---- the mutation run's survivors: the code shown per cell, the matrix's worst record, the fixes' records

def _code(calls, bodies=None):
    """A stand-in for ``gradkit.stacks.source.excerpt``: a header naming the version, then numbered lines (9 characters
    of number and mark, as the real one) of the body given for that release (default: the same for every release)."""
    def excerpt(package, relpath, qualname, marks, version="installed"):
        calls.append((package, qualname, version))
        body = (bodies or {}).get(version, ["a = 1", "b = 2"])
        if body is None:
            return None
        if body == "raise":
            raise OSError("planted")
        return "\n".join([f"--- {qualname} ({version})"] + [f"{n:>6}   {line}" for n, line in enumerate(body, 10)])
    return excerpt


def test_a_mechanisms_code_is_read_from_the_release_that_ran_and_shown_once_for_releases_that_ship_it_alike(
        monkeypatch):
    from gradkit.stacks import source

    calls = []
    monkeypatch.setattr(source, "excerpt", _code(calls))
    recs = [_rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.28.0", 0.9),
            _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.9),
            _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.9, ga=2),  # the same cell: read once
            _rec("ACC", "last_window", oracle.AFFECTED, "0.30.1", 0.5),  # another case with the same lines
            _rec("ACC", "sync_each_batch", oracle.NOT_AFFECTED, "1.15.0"),
            _rec("DDP", "sum_not_mean", oracle.AFFECTED, "2.13.0+cpu", 4.0)]  # no mechanism: a loop bug
    found = without_ds.mechanisms(recs)
    assert [m["cell"] for m in found] == ["ACC · sync_each_batch on accelerate 0.28.0, accelerate 0.30.1",
                                          "ACC · last_window on accelerate 0.30.1"]
    assert found[0]["releases"] == ["accelerate 0.28.0", "accelerate 0.30.1"] and "body" not in found[0]
    assert found[0]["code"].startswith("--- Accelerator.accumulate (0.28.0)")
    assert calls == [("accelerate", "Accelerator.accumulate", "0.28.0"), ("accelerate", "Accelerator.accumulate", "0.30.1"),
                     ("accelerate", "Accelerator.backward", "0.30.1")]


def test_releases_whose_lines_differ_are_shown_apart_and_the_installed_release_is_read_as_installed(monkeypatch):
    from gradkit.stacks import source

    calls = []
    monkeypatch.setattr(source, "excerpt", _code(calls, {"0.28.0": ["a = 1"], "0.30.1": ["b = 1"]}))
    recs = [_rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.28.0", 0.9),
            _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.9)]
    assert [m["cell"] for m in without_ds.mechanisms(recs)] == ["ACC · sync_each_batch on accelerate 0.28.0",
                                                               "ACC · sync_each_batch on accelerate 0.30.1"]
    calls.clear()
    raised = _rec("FSDP2", "sync_last", oracle.CANNOT_RUN, "2.13.0+cpu", error="uniform gradient dtype")
    without_ds.mechanisms([raised])
    assert calls == [("torch", "foreach_reduce", "installed")]  # the installed torch, local tag and all


def test_a_source_that_cannot_be_read_or_has_no_such_function_is_said(monkeypatch):
    from gradkit.stacks import source

    monkeypatch.setattr(source, "excerpt", _code([], {"0.28.0": "raise", "0.30.1": None}))
    found = without_ds.mechanisms([_rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.28.0", 0.9),
                                   _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.9)])
    assert found[0]["code"] == "(the source of accelerate 0.28.0 could not be read: planted)"
    assert found[1]["code"] == "(not found)"


def test_each_trainer_release_is_explained_by_its_own_mechanism(monkeypatch):
    from gradkit.stacks import source

    monkeypatch.setattr(source, "excerpt", _code([]))

    def sentence(rec):
        found = without_ds.mechanisms([rec])
        return found[0]["sentence"] if found else None

    assert sentence(_rec("HFT", "trainer", oracle.AFFECTED, "4.45.2", 1.003)).startswith(
        "each micro-batch's loss is the mean over its own label tokens")
    assert sentence(_rec("HFT", "trainer", oracle.AFFECTED, "4.46.3", 0.9)).startswith(
        "num_items_in_batch counts labels before the model shifts them (one token too many per sequence, B1), and")
    assert sentence(_rec("HFT", "trainer", oracle.NOT_AFFECTED, "4.46.3")) is None
    off = _rec("HFT", "trainer", oracle.AFFECTED, "5.23.0", 0.99, config={"model": "mlp", "trainer_args": {
        "average_tokens_across_devices": False}})
    assert sentence(off).startswith("average_tokens_across_devices=False")
    assert sentence(_rec("HFT", "trainer", oracle.AFFECTED, "5.23.0", 0.99)) is None  # no known mechanism there
    assert sentence(_rec("HFT", "avg_tokens_on", oracle.AFFECTED, "5.3.0", 0.9)).startswith("num_items_in_batch counts")
    unknown = {**_rec("HFT", "trainer", oracle.AFFECTED, "4.45.2", 1.003), "versions": {}}
    assert sentence(unknown).startswith("each micro-batch's loss")  # no release read: before every fix
    # each on its own releases only: 4.46.0 is past the first fix; avg_tokens_* only where affected
    assert sentence(_rec("HFT", "trainer", oracle.AFFECTED, "4.46.0", 0.9)).startswith(
        "num_items_in_batch counts labels before the model shifts them (one token too many per sequence, B1), and")
    assert sentence(_rec("HFT", "avg_tokens_off", oracle.AFFECTED, "5.23.0", 0.99)).startswith(
        "average_tokens_across_devices=False")
    assert sentence(_rec("HFT", "avg_tokens_off", oracle.AFFECTED, "4.46.3", 0.99)) is None
    assert sentence(_rec("HFT", "avg_tokens_off", oracle.NOT_AFFECTED, "5.23.0")) is None
    assert sentence(_rec("HFT", "avg_tokens_on", oracle.NOT_AFFECTED, "4.46.3")) is None


def test_a_cell_shows_its_worst_record_the_furthest_from_the_reference_and_its_words():
    recs = [_rec("ACC", "accumulate_ragged", oracle.AFFECTED, "0.30.1", 0.9, shape="near"),
            _rec("ACC", "accumulate_ragged", oracle.AFFECTED, "0.30.1", 1.5, shape="far", ga=2),
            _rec("ACC", "accumulate_ragged", oracle.AFFECTED, "0.30.1", 1.1, shape="between", ga=8)]
    (row,) = without_ds.matrix_rows(recs)
    assert (row["ratio"], row["shape"], row["where"], row["configs"]) == (1.5, "far", "W=2 GA=2 mlp", 3)
    raised = _rec("FSDP2", "sync_last", oracle.CANNOT_RUN, "2.13.0+cpu", reason="r" * 200,
                  config={"model": "mlp", "setting": "bf16 / fp32 reduce"})
    rows = without_ds.matrix_rows([raised, recs[0]])
    assert [r["setting"] for r in rows] == ["bf16 / fp32 reduce", ""]
    table = without_ds.markdown(rows).splitlines()
    assert table[2].endswith(f"| {'r' * 120} |") and table[3].endswith("| near |")
    assert without_ds.markdown([]) == "(no records)"
    assert without_ds.setting({"config": {"setting": "fp32"}}) == "fp32" and without_ds.setting({}) == ""


def test_a_fix_is_looked_for_on_the_broken_cells_own_path_only():
    recs = [_rec("ACC", "last_window", oracle.AFFECTED, "0.30.1", 0.5),
            _rec("ACC", "last_window_fixed", oracle.NOT_AFFECTED, "0.30.1"),
            _rec("HFT", "trainer", oracle.AFFECTED, "5.23.0", 0.9),  # no newer transformers ran: no fix claimed
            _rec("DDP", "sum_not_mean", oracle.AFFECTED, "2.13.0+cpu", 4.0)]
    assert [(f["problem"], f["after"]) for f in without_ds.fixes(recs)] == [
        ("ACC · last_window on accelerate 0.30.1", oracle.NOT_AFFECTED)]


def test_fsdp2s_raise_is_fixed_by_a_bf16_reduce_on_the_same_model_and_ga():
    def fsdp(verdict, setting, ga=2, model="conditional"):
        r = _rec("FSDP2", "sync_last", verdict, "2.13.0+cpu", ga=ga, error="x" if verdict == oracle.CANNOT_RUN else None)
        return {**r, "model": model, "config": {"model": model, "setting": setting}}

    recs = [fsdp(oracle.CANNOT_RUN, "bf16 / fp32 reduce"), fsdp(oracle.NOT_AFFECTED, "bf16 / bf16 reduce"),
            fsdp(oracle.AFFECTED, "bf16 / bf16 reduce", ga=4),  # another GA: not this raise's fix
            fsdp(oracle.AFFECTED, "bf16 / bf16 reduce", model="mlp")]
    (fix,) = without_ds.fixes(recs)
    assert fix["problem"] == "FSDP2 · sync_last on torch 2.13.0+cpu" and fix["before"] == oracle.CANNOT_RUN
    assert fix["after"] == oracle.NOT_AFFECTED and fix["configs_after"] == 1


def test_a_cells_worst_record_is_the_furthest_from_1_on_either_side_and_one_row_is_a_table():
    recs = [_rec("ACC", "accumulate_ragged", oracle.AFFECTED, "0.30.1", 1.5, shape="above"),
            _rec("ACC", "accumulate_ragged", oracle.AFFECTED, "0.30.1", 0.2, shape="below", ga=2)]
    (row,) = without_ds.matrix_rows(recs)
    assert (row["ratio"], row["shape"]) == (0.2, "below")
    assert without_ds.markdown([row]).splitlines()[2].startswith("| ACC | accumulate_ragged | accelerate 0.30.1 |")


def test_mechanisms_and_fixes_look_past_records_and_releases_that_have_none(monkeypatch):
    from gradkit.stacks import source

    monkeypatch.setattr(source, "excerpt", _code([]))
    found = without_ds.mechanisms([_rec("DDP", "no_sync", oracle.NOT_AFFECTED, "2.13.0+cpu"),
                                   _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.9)])
    assert [m["cell"] for m in found] == ["ACC · sync_each_batch on accelerate 0.30.1"]
    recs = [_rec("ACC", "last_window", oracle.AFFECTED, "0.30.1", 0.5),  # no fixed window ran on 0.30.1
            _rec("ACC", "last_window", oracle.AFFECTED, "0.31.0", 0.5),
            _rec("ACC", "last_window_fixed", oracle.NOT_AFFECTED, "0.31.0")]
    assert [f["problem"] for f in without_ds.fixes(recs)] == ["ACC · last_window on accelerate 0.31.0"]


def test_a_newer_release_fix_is_the_newest_release_of_that_same_case():
    recs = [_rec("HFT", "trainer", oracle.AFFECTED, "4.45.2", 1.003),
            _rec("HFT", "trainer", oracle.AFFECTED, "4.46.3", 0.9),
            _rec("HFT", "avg_tokens_off", oracle.AFFECTED, "5.23.0", 0.99)]  # another case on a newer release
    got = {f["problem"]: f for f in without_ds.fixes(recs)}
    fix = got["HFT · trainer on transformers 4.45.2"]
    assert fix["fix_release"] == "transformers 4.46.3" and fix["after"] == oracle.AFFECTED


def test_a_fix_says_its_ratio_and_a_trajectory_is_no_cell():
    recs = [_rec("ACC", "last_window", oracle.AFFECTED, "0.30.1", 0.5),
            _rec("ACC", "last_window_fixed", oracle.NOT_AFFECTED, "0.30.1", 1.0001)]
    (fix,) = without_ds.fixes(recs)
    assert (fix["ratio_before"], fix["ratio_after"]) == (0.5, 1.0001)
    symptom = _rec("HFT", "trainer", oracle.AFFECTED, "4.45.2", 2.0, role="symptom")
    assert [r["role"] for r in without_ds.matrix_rows([symptom, recs[0]])] == ["measured"]


def test_a_release_after_a_merged_one_is_still_read_and_lines_that_differ_only_first_are_apart(monkeypatch):
    from gradkit.stacks import source

    bodies = {"0.28.0": ["a = 1", "b = 2"], "0.30.1": ["a = 1", "b = 2"], "0.29.0": ["c = 3", "b = 2"]}
    monkeypatch.setattr(source, "excerpt", _code([], bodies))
    recs = [_rec("ACC", "sync_each_batch", oracle.AFFECTED, v, 0.9) for v in ("0.28.0", "0.30.1", "0.29.0")]
    assert [m["cell"] for m in without_ds.mechanisms(recs)] == [
        "ACC · sync_each_batch on accelerate 0.28.0, accelerate 0.30.1", "ACC · sync_each_batch on accelerate 0.29.0"]


def test_a_release_after_a_cell_already_read_is_still_read(monkeypatch):
    from gradkit.stacks import source

    calls = []
    monkeypatch.setattr(source, "excerpt", _code(calls, {"0.28.0": ["x = 0"]}))
    recs = [_rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.9),
            _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.30.1", 0.9, ga=2),  # the same cell: not read again
            _rec("ACC", "sync_each_batch", oracle.AFFECTED, "0.28.0", 0.9)]
    assert len(without_ds.mechanisms(recs)) == 2 and [c[2] for c in calls] == ["0.30.1", "0.28.0"]


def test_a_trainer_whose_framework_turned_model_accepts_loss_kwargs_off_is_explained_by_that_first():
    """The Trainer's path check of an axolotl run: its record says which setting the framework forced, and the
    mechanism named is that one (each micro-batch's loss its own token mean), before average_tokens_across_devices's."""
    rec = {"bug": "HFT", "case": "trainer", "verdict": "affected", "versions": {"transformers": "5.23.0"},
           "config": {"trainer_args": {"average_tokens_across_devices": False},
                      "trainer_attrs": {"model_accepts_loss_kwargs": False}}}
    assert check_paths.explanation(rec).startswith("model_accepts_loss_kwargs=False (axolotl sets it")
    rec["config"]["trainer_attrs"] = {"model_accepts_loss_kwargs": True}
    assert check_paths.explanation(rec).startswith("average_tokens_across_devices=False: each rank divides")
    assert check_paths.explanation({**rec, "verdict": "not-affected"}) is None
    rec["config"] = {"trainer_attrs": {"model_accepts_loss_kwargs": False}}
    assert check_paths.explanation(rec).startswith("model_accepts_loss_kwargs=False")
