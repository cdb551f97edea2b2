"""The fifth probe: torch DDP on a real 2-rank world, and the registry that makes it appear everywhere."""
import pytest

from gradkit import probes
from gradkit.judge import oracle, records
from gradkit.notebooks import explore, overview, runall
from gradkit.probes.probe import Probe
from gradkit.probes import ddp_no_sync

pytestmark = pytest.mark.usefixtures("warm_module")  # one import per stack for the module's runs


@pytest.fixture(scope="module")
def ddp_records():
    return ddp_no_sync.run(world_sizes=(2,), ga_values=(1, 4), timeout_s=120)


@pytest.mark.world
def test_ddp_no_sync_matches_the_reference_and_a_loop_bug_does_not(ddp_records):
    by = {(r["case"], r["ga"]): r for r in ddp_records}
    assert by[("control", 4)]["verdict"] == oracle.NOT_AFFECTED
    assert by[("no_sync", 4)]["verdict"] == oracle.NOT_AFFECTED
    assert by[("every_step", 4)]["verdict"] == oracle.NOT_AFFECTED
    bug = by[("sum_not_mean", 4)]
    assert bug["verdict"] == oracle.AFFECTED and abs(bug["metrics"]["norm_ratio"] - 4) < 1e-4
    assert by[("sum_not_mean", 1)]["verdict"] == oracle.NOT_AFFECTED  # nothing to sum at GA = 1
    assert ddp_no_sync.violations(ddp_records) == []


@pytest.mark.world
def test_ddp_is_exact_on_models_some_micro_batches_do_not_use_all_of():
    """find_unused_parameters=True where a shape has parts a micro-batch misses; each part judged on its own."""
    recs = ddp_no_sync.run(world_sizes=(2,), ga_values=(4,), models=("frozen", "conditional", "no_grad_step"),
                           timeout_s=180)
    for r in recs:
        if r["case"] != "sum_not_mean":
            assert r["verdict"] == oracle.NOT_AFFECTED, (r["model"], r["case"], r["reason"])
    bug = records.one(recs, case="sum_not_mean", model="conditional")
    assert bug["verdict"] == oracle.AFFECTED and bug["shape"] == "every micro-batch x4"  # the parts add nothing
    assert bug["steps"][0]["groups"]["expert skip_first"]["shape"] == "every micro-batch reaching it x4"
    assert bug["steps"][0]["groups"]["expert idle"]["rel_err"] == 0.0  # a part no micro-batch reached stays put
    assert ddp_no_sync.violations(recs) == []


@pytest.mark.world
def test_its_ranks_never_import_deepspeed_and_the_matrix_shows_its_own_stack(ddp_records):
    assert not any(r["imported_deepspeed"] for r in ddp_records)
    assert all("deepspeed" not in r["versions"] and r["versions"]["torch"] for r in ddp_records)
    cells = overview.verdict_matrix(ddp_records)
    (cell,) = cells
    assert cell["bug"] == "DDP" and cell["deepspeed"] == records.NO_DEEPSPEED and "torch 2." in cell["where"]
    assert overview.violations(cells, ["DDP"], ["installed"]) == []  # its one column is its own stack


def test_every_shipped_probe_is_registered_once_with_its_notebook():
    every = probes.registry()
    assert {"B1", "B2", "B3", "B4", "DDP"} <= set(every)
    for p in every.values():
        assert (runall.NOTEBOOKS / p.notebook).exists(), p.notebook
        assert p.knobs and all(v for v in p.knobs.values())
    assert probes.by_notebook()["07_without_deepspeed.ipynb"].id == "DDP"


def test_every_probe_is_split_at_the_process_boundary():
    """A probe's caller side is ``gradkit.probes.<module>`` (its ``PROBE``), what its ranks run ``gradkit.probes.ranks.<module>``
    (the ``ranks`` package adds no probe); a rank module never imports the caller's side: the runner, another
    probe's caller module, the commands, the notebooks."""
    import subprocess
    import sys

    from gradkit.probes import ds_config

    every = [*probes.registry().values(), ds_config.CHECK]
    assert {"B1", "B2", "B3", "B4", "DDP", "FSDP2", "ACC", "HFT"} == set(probes.registry())
    assert all(p.target == f"gradkit.probes.ranks.{p.module}:run_rank" for p in every)
    code = ("import importlib, sys\n"
            f"for m in {[p.module for p in every]!r}:\n"
            "    assert callable(importlib.import_module('gradkit.probes.ranks.' + m).run_rank)\n"
            "print(' '.join(m for m in sys.modules\n"
            "               if m.startswith(('gradkit.probes.', 'gradkit.commands', 'gradkit.notebooks'))\n"
            "               and not m.startswith(('gradkit.probes.ranks', 'gradkit.probes.probe'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []


def _toy(**kw) -> Probe:
    return Probe(id="T9", title="a toy", module="ddp_no_sync", notebook="07_without_deepspeed.ipynb",
                 measured_case="no_sync", ratio_meaning="r", advice="a", run=kw.get("run", ddp_no_sync.run),
                 quick_plan=lambda w: {"world_sizes": (w,), "ga_values": (2,)},
                 knobs={"world_size": [2], "ga": [2], "zero_stage": ["none"], "dtype": ["fp32"], "version": ["installed"]},
                 explorer_kwargs=lambda sel, d, t: {"world_sizes": [2], "ga_values": [sel["ga"]]}, init="torch",
                 packages=("torch",), order=99)


def test_a_registered_probe_reaches_the_overview_and_the_explorer_with_no_other_edit():
    calls = []
    toy = probes.register(_toy(run=lambda **kw: calls.append(kw) or []))
    try:
        assert "T9" in overview.quick_plan(2) and "T9" in explore.knobs()
        overview.run_probes(["installed"], ["T9"])
        assert calls == [{"stacks": [{}], "world_sizes": (2,), "ga_values": (2,), "device": "cpu", "timeout_s": 600}]
        ex = explore.ProbeExplorer(explore.default_selection("T9"), runner=lambda pid, kw: calls.append((pid, kw)) or [],
                                   interactive=False)
        assert "T9" in ex.bug.options
        ex.run()
        assert calls[-1] == ("T9", {"world_sizes": [2], "ga_values": [2]})
        assert toy.target == "gradkit.probes.ranks.ddp_no_sync:run_rank"
    finally:
        probes.unregister("T9")
    assert "T9" not in probes.registry()


@pytest.mark.world
def test_the_runner_reports_progress_from_the_ranks_as_cases_finish():
    from gradkit.probes import runner

    events = []
    with runner.listen(events.append):
        recs = ddp_no_sync.run(world_sizes=(2,), ga_values=(2,), timeout_s=120)
    worlds = [e for e in events if e["kind"] == "world"]
    cases = [e for e in events if e["kind"] == "case"]
    assert len(worlds) == 1 and worlds[0]["planned"] == 4 and worlds[0]["first_time"] == ""  # no DeepSpeed to build
    assert [e["done"] for e in cases] == [1, 2, 3, 4]
    assert [e["case"] for e in cases] == [r["case"] for r in recs]


def test_a_first_launch_says_what_makes_it_slow(tmp_path, monkeypatch):
    from gradkit.probes import runner
    from gradkit.probes import bf16_leak

    monkeypatch.setenv("GRADKIT_CACHE", str(tmp_path))  # nothing installed, nothing built
    said = runner.first_time({"deepspeed": "0.18.2"}, bf16_leak.PROBE)
    assert "installing DeepSpeed 0.18.2" in said and "building DeepSpeed 0.18.2's CPU comm op" in said
    assert runner.first_time({}, ddp_no_sync.PROBE) == ""
