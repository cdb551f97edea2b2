"""gradkit.judge.tables: the tables and sentences the notebooks print and the run-all summary collects, on records made
by hand. Each test asserts what a reader sees: a number's digits, a row per gradient record, a step marked off, a
lost rank said as such."""
from gradkit.judge import oracle, tables


def _rec(case="manual", verdict="not-affected", **kw):
    rec = {"role": "measured", "case": case, "version": "installed", "versions": {"deepspeed": "0.18.6"},
           "zero_stage": 2, "dtype": "fp32", "world_size": 2, "ga": 4, "verdict": verdict, "reason": "why",
           "metrics": {"norm_ratio": 1.0, "cosine": 1.0, "rel_l2": 0.0}, "attribution": {"misplaced_weight": 0.0}}
    return {**rec, **kw}


def _step(ratio, cosine=1.0, rel=0.0):
    return {"metrics": {"norm_ratio": ratio, "cosine": cosine, "rel_l2": rel}}


def test_numbers_are_printed_with_four_decimals_and_small_ones_with_four_significant_digits():
    assert tables.fmt(None) == "-"
    assert tables.fmt(1.234567) == "1.2346" and tables.fmt(0.5) == "0.5000"
    assert tables.fmt(0.0) == "0.0000"  # zero is not "small": fixed point
    assert tables.fmt(1.234567e-5) == "1.235e-05" and tables.fmt(-1.234567e-5) == "-1.235e-05"
    assert tables.fmt(0.000999) == "0.000999"  # just under 1e-3: significant digits
    assert tables.fmt(0.001) == "0.0010"  # 1e-3 itself: fixed point
    assert tables.fmt(-0.001) == "-0.0010"
    assert tables.fmt(1.234567, digits=2) == "1.23" and tables.fmt(1.234567e-5, digits=2) == "1.2e-05"
    assert tables.fmt(3) == "3" and tables.fmt("fp32") == "fp32" and tables.fmt(True) == "True"


def test_a_markdown_table_has_a_header_a_rule_and_one_line_per_row_with_missing_cells_as_dashes():
    md = tables.markdown_table([{"a": 1, "b": 0.5}, {"a": "x"}], ["a", "b"])
    assert md.splitlines() == ["| a | b |", "|---|---|", "| 1 | 0.5000 |", "| x | - |"]
    assert tables.markdown_table([], ["a"]) == "| a |\n|---|\n"


def test_per_step_ratios_are_marked_where_that_step_is_off_by_the_judged_dtype():
    ok, off = _step(1.0), _step(0.5, cosine=0.8, rel=0.5)
    assert tables.per_step(_rec(steps=[ok, off, ok])) == "1.000 / 0.500* / 1.000"
    assert tables.per_step(_rec(steps=[])) == "-" and tables.per_step(_rec()) == "-"
    small = _step(1.0 + 5e-3, rel=5e-3)  # off in fp32 (limit 1e-4), within bf16's (3e-2)
    assert oracle.severity({**small, "dtype": "fp32"}) > 1 >= oracle.severity({**small, "dtype": "bf16"})
    assert tables.per_step(_rec(steps=[small])) == "1.005*"
    assert tables.per_step(_rec(dtype="fp32", judge_dtype="bf16", steps=[small])) == "1.005"
    assert tables.per_step(_rec(dtype="bf16", steps=[small])) == "1.005"
    at, past = _step(1.0, rel=1e-4), _step(1.0, rel=1.5e-4)  # fp32's rel. error limit is 1e-4
    assert oracle.severity({**at, "dtype": "fp32"}) == 1.0  # at the limit is within it, as the oracle judges
    assert tables.per_step(_rec(steps=[at, past])) == "1.000 / 1.000*"


def test_verdict_rows_give_one_row_per_gradient_record_with_what_a_reader_needs():
    recs = [_rec(metrics={"norm_ratio": 0.25, "cosine": 0.9, "rel_l2": 0.75}, attribution={"misplaced_weight": 0.5},
                 verdict="affected", reason="lost micro-batches", optimizer="SGD", config={"model": "moe"},
                 steps=[_step(0.25, 0.9, 0.75)]),
            _rec(case="control", role="control", versions={}, version="0.16.9", metrics=None, attribution=None),
            _rec(case="trajectory", role="symptom")]
    rows = tables.verdict_rows(recs)
    assert len(rows) == 2  # the symptom (a trajectory) has no row
    assert [r["case"] for r in tables.verdict_rows(recs[::-1])] == ["control", "manual"]  # nor stops the rows after it
    assert rows[0] == {"deepspeed": "0.18.6", "case": "manual", "stage": 2, "dtype": "fp32", "W": 2, "GA": 4,
                       "optimizer": "SGD", "ratio": 0.25, "cosine": 0.9, "rel_err": 0.75, "misplaced": 0.5,
                       "ratio per step (* off)": "0.250*", "verdict": "affected", "reason": "lost micro-batches",
                       "model": "moe"}
    assert rows[1]["deepspeed"] == "0.16.9" and rows[1]["optimizer"] == "-" and rows[1]["model"] == "mlp"
    assert rows[1]["ratio"] is None and rows[1]["misplaced"] is None and rows[1]["ratio per step (* off)"] == "-"
    assert rows[1]["case"] == "control" and rows[1]["stage"] == 2


def test_the_verdict_table_has_a_model_column_only_where_the_records_ran_on_several_models():
    one = tables.verdict_table([_rec(), _rec(case="control")])
    assert one.splitlines()[0] == "| " + " | ".join(tables.VERDICT_COLUMNS) + " |" and len(one.splitlines()) == 4
    assert "| 0.18.6 | manual | 2 | fp32 | 2 | 4 | - | 1.0000 | 1.0000 | 0.0000 | 0.0000 | - | not-affected |" in one
    two = tables.verdict_table([_rec(), _rec(config={"model": "moe"})])
    assert two.splitlines()[0].startswith("| model | deepspeed |")
    assert [line.split(" | ")[0] for line in two.splitlines()[2:]] == ["| mlp", "| moe"]


def test_cases_that_could_not_run_are_said_by_reason_and_a_lost_rank_is_said_as_such():
    import pytest

    died = "not run: the world stopped after case 3 of 9: rank 1 died: exit 1\nTraceback ..."
    signal = "rank 0 killed by signal 9 (SIGKILL)"
    refused = "DeepSpeed refuses fp16 on CPU"
    recs = ([_rec(case=f"c{i}", verdict="cannot-run", reason=died, ga=i) for i in range(10)]
            + [_rec(case="z", verdict="cannot-run", reason=signal), _rec(case="y", verdict="cannot-run", reason=refused),
               _rec(case="ok")])
    lines = tables.cannot_run_summary(recs).splitlines()
    assert len(lines) == 3  # one per reason, in the order first met; the case that ran is not counted
    assert lines[0].startswith("The world LOST A RANK: 10 case(s) are cannot-run (c0 (GA 0), c1 (GA 1), ")
    assert ", ...) because not run: the world stopped after case 3 of 9: rank 1 died: exit 1" in lines[0]
    assert lines[0].count("(GA ") == 8 and "Traceback" not in lines[0]  # eight cases named, the first line only
    assert lines[1] == f"The world LOST A RANK: 1 case(s) are cannot-run (z (GA 4)) because {signal}"
    assert lines[2] == f"Could not run: 1 case(s) are cannot-run (y (GA 4)) because {refused}"
    eight = tables.cannot_run_summary([_rec(case=f"c{i}", verdict="cannot-run", reason=refused) for i in range(8)])
    assert "c7 (GA 4)) because" in eight and "..." not in eight  # exactly eight: all named, no ellipsis
    nine = tables.cannot_run_summary([_rec(case=f"c{i}", verdict="cannot-run", reason=refused) for i in range(9)])
    assert "9 case(s)" in nine and "c7 (GA 4), ...) because" in nine and "c8" not in nine  # nine: eight and "..."
    same = tables.cannot_run_summary([_rec(verdict="cannot-run", reason=refused)] * 2)
    assert same.startswith("Could not run: 2 case(s) are cannot-run (manual (GA 4)) because")  # one name, two cases
    long = tables.cannot_run_summary([_rec(verdict="cannot-run", reason="x" * 500 + "y"),
                                      _rec(verdict="cannot-run", reason="x" * 500 + "z")])
    assert long.count("\n") == 0 and long.endswith("because " + "x" * 400)  # one reason, cut at 400 characters
    assert tables.cannot_run_summary([_rec(), _rec()]) == "every one of the 2 cases ran"
    with pytest.raises(KeyError):  # a cannot-run record always has its reason
        tables.cannot_run_summary([{"verdict": "cannot-run", "case": "x", "ga": 1}])


def test_any_probes_records_are_tabled_by_the_named_fields():
    recs = [_rec(matches="B3", optimizer="SGD", steps=[_step(1.0)]), _rec(case="t", role="symptom"),
            _rec(case="c", versions={}, version="0.17.0", metrics=None, attribution=None)]
    md = tables.table(recs, ["deepspeed", "case", "W", "GA", "N", "stage", "dtype", "optimizer", "ratio", "cosine",
                             "rel_err", "misplaced", "matches", "per step", "verdict", "reason"])
    lines = md.splitlines()
    assert len(lines) == 4  # header, rule, two rows: the symptom left out
    assert lines[2] == ("| 0.18.6 | manual | 2 | 4 | 4 | 2 | fp32 | SGD | 1.0000 | 1.0000 | 0.0000 | 0.0000 | B3 | "
                        "1.000 | not-affected | why |")
    assert lines[3] == "| 0.17.0 | c | 2 | 4 | 4 | 2 | fp32 | - | - | - | - | - | - | - | not-affected | why |"
    assert set(tables.FIELDS) >= {"deepspeed", "per step", "matches"}
    assert tables.table([{"case": "x", "verdict": "v", "reason": "r"}], ["case"]).splitlines()[2] == "| x |"
