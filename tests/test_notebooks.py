"""The B4 notebook executes under papermill with small parameters and records its verdicts."""
import json

import pytest

from kit import runall

pytestmark = pytest.mark.world


def test_bf16_notebook_runs_and_finds_the_bug(repo, tmp_path):
    code = runall.main([str(repo / "notebooks" / "04_bf16_leak.ipynb"), "--params",
                        str(repo / "scripts" / "params" / "quick.yaml"), "--out", str(tmp_path), "--timeout", "900"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0, summary
    findings = json.loads((tmp_path / "04_bf16_leak.findings.json").read_text())
    assert set(findings["0.18.9"]["leak"].values()) == {"affected"}
    assert set(findings["installed"]["leak"].values()) == {"not-affected"}
    assert "04_bf16_leak.ipynb" in (tmp_path / "summary.md").read_text()
    executed = json.loads((tmp_path / "04_bf16_leak.ipynb").read_text())
    assert any(c.get("outputs") for c in executed["cells"] if c["cell_type"] == "code")
