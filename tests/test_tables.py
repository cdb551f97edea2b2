"""The README's result tables come from a run's records: generated blocks, replaced in place, one run's records only."""
import json

from kit import records, tables


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
    made = tables.render(tmp_path)
    assert set(made) == {"B4"}
    t = made["B4"]
    assert "run R (scripts/params/default.yaml)" in t and "GA = 4" in t  # the older run's GA 8 record is not read
    assert "| 0.18.9 | bug config | 1.0920 |" in t and "0.1251 / 0.1253" in t and "| 0.19.8 |" in t
    readme = "intro\n<!-- gradkit:table B4 -->\nold numbers 9.99\n<!-- /gradkit:table -->\n<!-- gradkit:table B2 -->\nkept\n<!-- /gradkit:table -->\n"
    text, done = tables.fill(readme, made)
    assert done == ["B4"] and "9.99" not in text and "1.0920" in text and "kept" in text
    assert tables.fill(text, made)[0] == text  # idempotent
