"""The prefetch step of run-all: it knows every stack the notebooks will run, does their one-off work (overlay
installs, comm-op builds) before any notebook starts, stops with the run, and refuses a release that does not
exist before any kernel starts."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from gradkit import config as kconfig
from gradkit import launch
from gradkit.notebooks import runall_params
from gradkit.probes import runner
from gradkit.stacks import prefetch
from gradkit.stacks import versions as kversions
from gradkit.probes import ds_config, zero_boundary

pytestmark = pytest.mark.world


def _needs(params_file: str) -> list[prefetch.Need]:
    """What run-all with this parameters file would prefetch, from the notebooks' own ``check_notebook``."""
    spec = runall_params.load_params(params_file)
    pairs = []
    for path in sorted(runall_params.NOTEBOOKS.glob("*.ipynb")):
        known = runall_params.notebook_parameters(path)
        folder = runall_params.REPO / "runs" / "x"
        params = runall_params.params_for(path, spec, folder, folder, known)
        pairs += runall_params.check_notebook_values(path, params, known)
    return prefetch.needs_of(pairs)


def test_the_prefetch_names_every_stack_the_notebooks_will_run(repo):
    quick = yaml.safe_load((repo / "scripts" / "params" / "quick.yaml").read_text())["notebooks"]
    got = {(n.label, n.init) for n in _needs(str(repo / "scripts" / "params" / "quick.yaml"))}
    want = {(runner.stack_label(s), "deepspeed") for s in quick["01_trainer_loss_kwargs"]["STACKS"]}
    want |= {(v, "deepspeed") for nb in ("02_pipeline_ga", "03_zero_boundary", "04_bf16_leak") for v in quick[nb]["VERSIONS"]}
    want |= {("installed", "torch")}  # 07: plain torch DDP and FSDP2, and the installed accelerate / transformers
    from gradkit.notebooks import without_ds  # 07: every Accelerate release and Trainer stack it names, as plain-torch worlds
    from gradkit.probes import trainer_ddp

    want |= {(runner.stack_label(without_ds.accelerate_stack(v)), "torch") for v in quick["07_without_deepspeed"]["ACCELERATE_VERSIONS"]}
    want |= {(runner.stack_label(trainer_ddp.STACKS[s]), "torch") for s in quick["07_without_deepspeed"]["TRAINER_STACKS"]}
    story = quick["08_new_bug"]  # 08: the story's releases and each known bug's, all DeepSpeed worlds
    want |= {(v, "deepspeed") for v in story["STORY_RELEASES"] + [v for vs in story["KNOWN_RELEASES"].values() for v in vs]}
    assert got == want, f"prefetch would prepare {sorted(got)}, the notebooks run {sorted(want)}"
    # the overview reads run-all's records (LOAD_RESULTS): it adds nothing; run alone it needs its own stacks
    over = runall_params.NOTEBOOKS / "00_overview.ipynb"
    pairs = runall_params.check_notebook_values(over, {"LOAD_RESULTS": "", "VERSIONS": ["0.18.9", "installed"]})
    assert {(p.id, runner.stack_label(s)) for p, s in pairs} >= {("B3", "0.18.9"), ("B3", "installed"), ("DDP", "installed")}
    assert ("DDP", "0.18.9") not in {(p.id, runner.stack_label(s)) for p, s in pairs}  # no DeepSpeed in its stack


def _cold_env(tmp_path) -> dict:
    """A kit cache with nothing in it: the installed release's comm op has to be built."""
    return {**os.environ, "GRADKIT_CACHE": str(tmp_path / "cache")}


def test_a_prefetch_builds_what_a_world_would_build_and_stops_with_the_run(tmp_path, repo):
    env = _cold_env(tmp_path)
    need = prefetch.needs_of([(zero_boundary.PROBE, {})])
    suite_cache = kconfig.cache_dir()  # the suite's own (tests/conftest.py): the machine's kit cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRADKIT_CACHE", env["GRADKIT_CACHE"])
        assert [why for _, why in prefetch.pending(need)] == [runner.first_time({}, zero_boundary.PROBE)] != [""]

    # 1. Stopped while it builds: the run-all ends at once, its prefetch, ranks and compiler with it, no notebook ran
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"notebooks": {"03_zero_boundary": {"VERSIONS": ["installed"]}}}))
    run = subprocess.Popen([sys.executable, "-m", "gradkit.notebooks.runall", "03_zero_boundary", "--params", str(params), "--out",
                            str(tmp_path / "out"), "--no-progress", "--no-site"], cwd=str(repo), env=env)
    deadline, building = time.monotonic() + 120, []
    while not building and time.monotonic() < deadline:
        building = [p for p in psutil.Process(run.pid).children(recursive=True) if "gradkit.launch.worker" in " ".join(p.cmdline())]
        time.sleep(0.2)
    assert building, "the prefetch never started its one-rank world"
    tree = psutil.Process(run.pid).children(recursive=True)
    assert any("gradkit.stacks.prefetch" in " ".join(p.cmdline()) for p in tree)
    run.send_signal(signal.SIGINT)
    assert run.wait(30) == 130
    assert psutil.wait_procs(tree, timeout=5)[1] == [], "the prefetch's processes outlived the stop"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["prefetch"]["status"] == "stopped"
    assert [e["status"] for e in summary["notebooks"]] == ["stopped"]

    # 2. Run to its end: the comm op is built, and the first world after it has nothing left to do. The compiled
    #    objects of the suite's own build are put in place (ninja then links the op: the build without its ~45 s
    #    compile); the op itself is not.
    key = kversions.Stack({"deepspeed": kversions.installed_version("deepspeed")}).extensions_key
    suite = suite_cache / "torch_extensions" / key
    if not list(suite.rglob("*.o")):  # a fresh clone where no world has built it yet: the suite needs it anyway
        launch.run_world("gradkit.launch.selftest:ping", {}, world_size=1, timeout_s=600)
    shutil.copytree(suite, tmp_path / "cache" / "torch_extensions" / key, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.so", "lock"))
    needs = tmp_path / "needs.json"
    needs.write_text(json.dumps([n.as_json() for n in need]))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gradkit.stacks.prefetch", "--needs", str(needs), "--no-progress"], env=env,
                          cwd=str(repo), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "installed: installed, comm op built" in done.stderr
    again = subprocess.run([sys.executable, "-c", "from gradkit.stacks import prefetch; from gradkit.probes import runner, zero_boundary as z; "
                            "print(runner.first_time({}, z.PROBE) or 'nothing')"], env=env, cwd=str(repo),
                           capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() == "nothing", again.stdout + again.stderr
    print(f"comm op built by the prefetch in {time.monotonic() - t0:.1f} s")


def test_a_release_the_index_does_not_have_is_refused_before_any_notebook(tmp_path, repo):
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"notebooks": {"04_bf16_leak": {"VERSIONS": ["0.0.77"]}}}))
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "gradkit.notebooks.runall", "04_bf16_leak", "--params", str(params), "--out", str(out),
                          "--no-progress"], cwd=str(repo), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == "error: deepspeed==0.0.77 is not a release on the package index"
    assert not (out / "04_bf16_leak.ipynb").exists() and not (out / "summary.json").exists()
    assert not list(kversions.overlay_root().glob(".deepspeed-0.0.77*"))


def test_a_check_probe_names_its_stacks_too():
    sweep_nb = runall_params.NOTEBOOKS / "06_sweep.ipynb"
    pairs = runall_params.check_notebook_values(sweep_nb, {"STACKS": [{}, {"deepspeed": "0.18.9"}]})
    assert [(p, s) for p, s in pairs] == [(ds_config.CHECK, {}), (ds_config.CHECK, {"deepspeed": "0.18.9"})]
