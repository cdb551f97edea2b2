"""The docs' result tables (docs/bugs.md) come from a run's records: generated blocks, replaced in place, one run's records only."""
import json
from pathlib import Path

from gradkit.judge import records
from gradkit.notebooks import readme_tables


def b4(ds, case, verdict, ratio, run_id="R", ga=4):
    return {"bug": "B4", "case": case, "role": "measured" if case == "leak" else "workaround", "verdict": verdict,
            "ga": ga, "dtype": "bf16", "world_size": 2, "version": ds, "versions": {"deepspeed": ds}, "run_id": run_id,
            "metrics": {"norm_ratio": ratio, "cosine": 0.95, "rel_l2": 0.3}, "predicted_misplaced_weight": 0.125,
            "rank_buffers": [{"attribution": {"misplaced_weight": 0.1251}}, {"attribution": {"misplaced_weight": 0.1253}}]}


def test_tables_are_written_from_the_runs_records_into_the_readme_blocks(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "R", "notebooks": {"04_bf16_leak.ipynb": "ok"}}))
    (tmp_path / "summary.json").write_text(json.dumps({"params_file": "scripts/params/default.yaml"}))
    records.save([b4("0.18.9", "leak", "affected", 1.092), b4("0.19.8", "leak", "not-affected", 1.0002),
                  b4("0.18.9", "leak", "not-affected", 1.0, run_id="OLD", ga=8)], tmp_path / "04_bf16_leak.jsonl")
    made = readme_tables.render(tmp_path)
    assert set(made) == {"B4"}
    t = made["B4"]
    assert "run R (scripts/params/default.yaml)" in t and "GA = 4" in t  # the older run's GA 8 record is not read
    assert "| 0.18.9 | bug config | 1.0920 |" in t and "0.1251 / 0.1253" in t and "| 0.19.8 |" in t
    readme = "intro\n<!-- gradkit:table B4 -->\nold numbers 9.99\n<!-- /gradkit:table -->\n<!-- gradkit:table B2 -->\nkept\n<!-- /gradkit:table -->\n"
    text, done = readme_tables.fill(readme, made)
    assert done == ["B4"] and "9.99" not in text and "1.0920" in text and "kept" in text
    assert readme_tables.fill(text, made)[0] == text  # idempotent


def test_every_bug_has_a_table_from_its_records():
    stage = lambda s, x: {"stage": s, "metrics": {"norm_ratio": x}}  # noqa: E731
    b2 = [{"bug": "B2", "case": "pipeline", "dtype": "fp32", "world_size": 2, "ga": 8, "zero_stage": z, "verdict": v,
           "versions": {"deepspeed": ds}, "version": ds, "config": {"micro_batch": 1}, "stages": [stage(0, r0), stage(1, 1.0)],
           "logged_grad_norm": None, "reference_grad_norm": 1.0}
          for ds, z, v, r0 in (("0.18.6", 0, "affected", 0.125), ("0.19.8", 0, "not-affected", 1.0), ("0.19.10", 1, "affected", 0.5))]
    t = readme_tables.b2(b2)
    assert "split 1 x 8" in t and t.index("| 0.18.6 |") < t.index("| 0.19.8 |") < t.index("| 0.19.10 |")  # numeric order
    b3 = [{"bug": "B3", "case": "manual", "dtype": "fp32", "world_size": 2, "ga": n, "zero_stage": 2, "verdict": "affected",
           "config_verdict": "affected", "matches": "last micro-batch / N", "versions": {"deepspeed": ds}, "version": ds,
           "metrics": {"norm_ratio": x}} for ds in ("0.18.6", "0.19.8") for n, x in ((1, 1.0), (4, 0.403))]
    assert "| 2 | 0.18.6, 0.19.8 | 0.403 | last micro-batch / N | affected |" in readme_tables.b3(b3)
    b1 = [{"bug": "B1", "case": c, "ga": g, "path": "no_ds", "version": "installed", "world_size": 2, "verdict": "affected",
           "gas_verdict": gv, "token_factor": 0.9, "versions": {"transformers": "5.3.0", "deepspeed": "0.18.9"},
           "metrics": {"norm_ratio": x}} for c, g, gv, x in (("gas1", 1, "n/a", 0.9), ("trainer", 8, "affected", 0.1125))]
    assert "| 5.3.0 / 0.18.9 | no_ds | 0.900 -> 0.113 | 0.9000 | **no** | **no** |" in readme_tables.b1(b1)


def test_the_bugs_page_holds_a_block_per_table_and_fill_replaces_them_there_only():
    """The tables moved from the README to readme_tables.PAGE (docs/bugs.md): each bug's block is there, and the
    command's fill rewrites exactly those blocks of the page, nothing around them."""
    page = Path(__file__).resolve().parents[1] / readme_tables.PAGE
    text = page.read_text()
    made = {bug: f"<sub>generated</sub>\n\n{bug} new\n" for bug in readme_tables.TABLES}
    filled, done = readme_tables.fill(text, made)
    assert sorted(done) == sorted(readme_tables.TABLES) and all(f"{bug} new" in filled for bug in readme_tables.TABLES)
    assert readme_tables.BLOCK.sub("", filled) == readme_tables.BLOCK.sub("", text)  # the page's own text untouched
