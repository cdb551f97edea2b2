"""The bug notebooks execute under papermill with small parameters (scripts/params/quick.yaml) and record verdicts."""
import json

import pytest

from kit import runall

pytestmark = pytest.mark.world
NOTEBOOKS = ("01_trainer_loss_kwargs", "02_pipeline_ga", "03_zero_boundary", "04_bf16_leak")


@pytest.fixture(scope="module")
def quick_run(repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    code = runall.main([*(str(repo / "notebooks" / f"{nb}.ipynb") for nb in NOTEBOOKS), "--params",
                        str(repo / "scripts" / "params" / "quick.yaml"), "--out", str(out), "--timeout", "900"])
    return code, out


def test_every_notebook_ran_and_is_summarised(quick_run):
    code, out = quick_run
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0, [(e["notebook"], e.get("error")) for e in summary["notebooks"] if e["status"] != "ok"]
    md = (out / "summary.md").read_text()
    for nb in NOTEBOOKS:
        assert f"{nb}.ipynb" in md
        executed = json.loads((out / f"{nb}.ipynb").read_text())
        assert any(c.get("outputs") for c in executed["cells"] if c["cell_type"] == "code")


def test_bf16_notebook_finds_the_bug(quick_run):
    findings = json.loads((quick_run[1] / "04_bf16_leak.findings.json").read_text())
    assert set(findings["0.18.9"]["leak"].values()) == {"affected"}
    assert set(findings["installed"]["leak"].values()) == {"not-affected"}


def test_zero_boundary_notebook_finds_the_reset(quick_run):
    findings = json.loads((quick_run[1] / "03_zero_boundary.findings.json").read_text())
    assert findings == {"installed ZeRO-0 fp32 W2": "not-affected", "installed ZeRO-2 fp32 W2": "affected",
                        "installed ZeRO-3 fp32 W2": "not-affected"}


def test_pipeline_notebook_finds_the_summing_release(quick_run):
    findings = json.loads((quick_run[1] / "02_pipeline_ga.findings.json").read_text())
    old, new = findings["0.18.2 W2 fp32 ZeRO-0"], findings["installed W2 fp32 ZeRO-0"]
    assert old["verdict"] == "affected" and old["affected_stages"] == [0, 1]
    assert set(old["matches"]["0"]) == {"sum (x GA)"}
    assert new["verdict"] == "not-affected" and new["affected_stages"] == []


def test_trainer_notebook_blames_the_right_path(quick_run):
    findings = json.loads((quick_run[1] / "01_trainer_loss_kwargs.findings.json").read_text())
    seed = "deepspeed=0.18.9 transformers=5.3.0"
    assert findings[f"{seed} | no_ds"]["gas_verdict"] == "affected"
    assert findings[f"{seed} | ds_zero0"]["gas_verdict"] == "not-affected"
    assert all(f["verdict"] == "not-affected" for k, f in findings.items() if k.startswith("installed"))
