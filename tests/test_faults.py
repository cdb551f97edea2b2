"""Faults in real worlds: a rank killed mid-run is named and the finished cases are kept; ranks die with their
caller; eight worlds rendezvous at once without a port race."""
import os
import signal
import subprocess
import sys
import threading
import tempfile
import time

import psutil
from pathlib import Path

import pytest

from gradkit import launch
from gradkit.judge import oracle
from gradkit.probes import zero_boundary as zb

pytestmark = pytest.mark.world


def _workers(pid: int) -> list[psutil.Process]:
    """The rank processes below ``pid`` now, started or forked (``gradkit.launch.ranks_below``)."""
    return [p for _, p in launch.ranks_below(pid)]


def _ranks_of(pid: int) -> dict[int, psutil.Process]:
    """``{rank: process}`` of the ranks below ``pid``."""
    return dict(launch.ranks_below(pid))


# How long a test waits for processes to die before it calls them orphaned: a hang guard, 10x and more over the
# measured kill times (under 3 s on 2 busy cores); how fast they really die is scripts/bench.py's to say.
KILL_GUARD_S = 30.0


def _gone(procs, within_s: float) -> float | None:
    """Seconds until every process is gone (zombies count as gone), or None past ``within_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        alive = []
        for p in procs:
            try:
                alive += [p] if p.status() != psutil.STATUS_ZOMBIE else []
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def test_a_rank_killed_mid_run_is_named_and_the_finished_cases_are_kept():
    from gradkit.probes import runner

    out, cases = {}, []

    def run():
        with runner.listen(lambda event: cases.append(event) if event["kind"] == "case" else None):
            out["recs"] = zb.run(world_sizes=(2,), n_values=(1, 2, 4, 8), stages=(0, 3), dtypes=("fp32", "bf16"),
                                 timeout_s=300)

    todo = threading.Thread(target=run)
    todo.start()
    deadline = time.monotonic() + 120
    victim = None
    while victim is None and time.monotonic() < deadline:
        ranks = _ranks_of(os.getpid())
        if 1 in ranks and len(cases) >= 3:  # rank 0 has reported three finished cases
            victim = ranks[1]
        time.sleep(0.05)
    assert victim is not None, "the world never got three cases in"
    victim.send_signal(signal.SIGKILL)
    todo.join(120)
    recs = out["recs"]
    done = [r for r in recs if r["verdict"] != oracle.CANNOT_RUN]
    lost = [r for r in recs if r["verdict"] == oracle.CANNOT_RUN]
    assert len(done) >= 3 and lost, (len(done), len(lost))
    assert all(r.get("metrics") for r in done)  # what finished before the kill keeps its measurement
    reason = lost[-1]["reason"]
    assert "rank 1 died: killed by signal 9 (SIGKILL)" in reason, reason


def test_ranks_die_within_seconds_when_their_caller_is_killed(tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", (
        "from gradkit import launch\n"
        "launch.run_world('gradkit.launch.selftest:hang_on_rank', {'rank': 0, 'seconds': 600}, world_size=2,"
        " init='torch', timeout_s=600)\n")], cwd=str(launch.REPO_ROOT))
    deadline = time.monotonic() + 60
    ranks = {}
    while len(ranks) < 1 and time.monotonic() < deadline:  # rank 1 returns at once; rank 0 hangs
        ranks = {r: p for r, p in _ranks_of(caller.pid).items() if r == 0}
        time.sleep(0.1)
    assert ranks, "no rank came up"
    time.sleep(1.0)
    mine = [f for f in Path(tempfile.gettempdir()).glob("gradkit-world-*")
            if (f / launch.OWNER_FILE).exists() and (f / launch.OWNER_FILE).read_text().split()[0] == str(caller.pid)]
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    took = _gone(list(ranks.values()), within_s=KILL_GUARD_S)
    assert took is not None, "a rank outlived its caller by more than 5 s"
    # the killed caller never cleaned its world's folder: the next world does
    assert len(mine) == 1 and mine[0].exists()
    launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, init="torch", timeout_s=60)
    assert not mine[0].exists()


def test_eight_worlds_at_once_rendezvous_without_a_port_race():
    results, errors = [], []

    def one():
        try:
            results.append(launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, init="torch",
                                            timeout_s=240))
        except launch.LaunchError as e:
            errors.append(str(e)[:300])

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(results) == 8 and all([r["rank_sum"] for r in out] == [1.0, 1.0] for out in results)


HANG = ("from gradkit import launch\n"
        "launch.run_world('gradkit.launch.selftest:hang_on_rank', {'rank': 0, 'seconds': 600}, world_size=2, "
        "init='torch', timeout_s=600)")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stopping_a_run_all_stops_everything_and_says_so(tmp_path, sig, code):
    import json

    from tests.test_runall import _notebook

    nbs = [_notebook(tmp_path / f"{n}.ipynb", HANG) for n in ("a_world", "b_world", "c_queued")]
    out = tmp_path / "out"
    runner = subprocess.Popen([sys.executable, "-m", "gradkit.notebooks.runall", *map(str, nbs), "--out", str(out), "--jobs", "2",
                               "--timeout", "600", "--no-progress"], cwd=str(launch.REPO_ROOT))
    deadline, ranks = time.monotonic() + 120, {}
    while len(ranks) < 2 and time.monotonic() < deadline:  # both running notebooks have their hanging rank 0 up
        ranks = {p.pid: p for p in _workers(runner.pid)}
        time.sleep(0.2)
    assert len(ranks) >= 2, "the notebooks' worlds never came up"
    tree = psutil.Process(runner.pid).children(recursive=True)  # papermill, kernels, ranks
    t0 = time.monotonic()
    runner.send_signal(sig)
    assert runner.wait(30) == code
    took = _gone(tree, within_s=KILL_GUARD_S)
    assert took is not None, "processes of the run outlived the stop"
    summary = json.loads((out / "summary.json").read_text())
    status = {e["notebook"]: e["status"] for e in summary["notebooks"]}
    assert summary["stopped"] == sig.name and status == {"a_world.ipynb": "stopped", "b_world.ipynb": "stopped",
                                                         "c_queued.ipynb": "stopped"}
    assert f"The run was stopped ({sig.name})" in (out / "summary.md").read_text()
    assert not list(tmp_path.glob("gradkit-*")) and not any(out.glob("gradkit-world-*"))


def test_a_notebook_stopped_at_its_limit_takes_its_kernel_ranks_and_world_folder_with_it(tmp_path):
    import glob
    import tempfile

    from gradkit.notebooks import runall
    from tests.test_runall import _notebook

    nb = _notebook(tmp_path / "limit_world_x7.ipynb", HANG)
    seen = []

    def watch():  # the world's ranks while the notebook runs
        for _ in range(300):
            seen.extend(_workers(os.getpid()))
            if seen:
                return
            time.sleep(0.1)

    w = threading.Thread(target=watch)
    w.start()
    # the limit leaves a loaded machine time to start the kernel and the world (~10 s); the rest of it is waited out
    code = runall.main([str(nb), "--out", str(tmp_path / "out"), "--timeout", "30", "--no-progress"])
    w.join()
    assert code == 1 and seen, "the notebook's world never came up"
    assert _gone(seen, within_s=KILL_GUARD_S) is not None, "ranks outlived their notebook's time limit"
    assert not glob.glob(f"{tempfile.gettempdir()}/gradkit-limit_world_x7-*"), "the notebook's temp folder was left"


def test_a_lost_rank_is_said_plainly_with_the_cases_it_cost():
    from gradkit.judge import tables

    recs = [{"verdict": "cannot-run", "case": c, "ga": 4, "reason": "could not run: not run: the world stopped after case 3 "
             "of 9: rank 1 died: killed by signal 9 (SIGKILL), without a Python traceback"} for c in ("manual", "control")]
    text = tables.cannot_run_summary(recs + [{"verdict": "affected", "case": "x", "ga": 1, "reason": ""}])
    assert text.startswith("The world LOST A RANK: 2 case(s) are cannot-run (control (GA 4), manual (GA 4))")
    assert "rank 1 died: killed by signal 9" in text
    assert tables.cannot_run_summary(recs[:0]) == "every one of the 0 cases ran"


@pytest.mark.parametrize("name", ["accumulator_norms", "attribution_bars", "stage_ratio_vs_ga", "path_ratio_vs_ga"])
def test_a_figure_of_a_world_where_nothing_ran_says_so_instead_of_failing(name):
    import matplotlib

    matplotlib.use("Agg")
    from gradkit.notebooks import probe_plots

    fig = getattr(probe_plots, name)([])
    assert any("nothing to draw" in t.get_text() for ax in fig.axes for t in ax.texts)


def test_interrupting_an_explorer_run_stops_its_world_within_seconds():
    import _thread

    from gradkit.notebooks import explore

    hang = lambda module, kwargs: launch.run_world(  # noqa: E731 - a probe that never ends
        "gradkit.launch.selftest:hang_on_rank", {"rank": 0, "seconds": 600}, world_size=2, init="torch", timeout_s=600)
    ex = explore.ProbeExplorer(explore.default_selection("B3"), runner=hang, interactive=True)
    seen = []

    def interrupt_once_the_ranks_are_up():
        for _ in range(600):
            seen.extend(_workers(os.getpid()))
            if seen:
                time.sleep(0.5)
                _thread.interrupt_main()  # what the kernel's Interrupt does to a running callback
                return
            time.sleep(0.1)

    threading.Thread(target=interrupt_once_the_ranks_are_up, daemon=True).start()
    t0 = time.monotonic()
    # the kernel's Interrupt raises KeyboardInterrupt in the running callback (Python's own SIGINT handler);
    # an earlier test of this process (a kernel client) may have left another handler in place
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert ex.run() == []
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen and time.monotonic() - t0 < 60
    assert _gone(seen, within_s=KILL_GUARD_S) is not None, "the interrupted world's ranks live on"
    assert "interrupted" in ex.status.value and "1 world(s) stopped" in ex.status.value


def test_interrupting_a_probe_cell_in_a_real_kernel_kills_its_ranks(repo):
    """A probe cell that finished leaves its world warm for the next cell (the same ranks, no start-up). A probe
    started from a cell, and the kernel's Interrupt (SIGINT to the kernel, as JupyterLab's stop square): the cell
    ends with KeyboardInterrupt, the world's ranks are gone within seconds, the kernel lives on. A kernel shut
    down (or restarted) takes its warm ranks with it."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="gradkit", cwd=str(repo))
    try:
        kernel = psutil.Process(km.provisioner.process.pid)
        small = ("from gradkit.probes import zero_boundary as zb\n"
                 "recs = zb.run(n_values=(1, 4), stages=(2,), dtypes=('fp32',), fixes=())\n"
                 "assert {r['verdict'] for r in recs} == {'affected', 'not-affected'}")
        assert kc.execute_interactive(small, timeout=120)["content"]["status"] == "ok"
        warm = {p.pid for p in _workers(kernel.pid)}
        assert len(warm) == 2, "the finished cell's world did not stay warm"
        assert kc.execute_interactive(small, timeout=120)["content"]["status"] == "ok"
        assert {p.pid for p in _workers(kernel.pid)} == warm, "the next cell did not reuse the warm ranks"
        cell = kc.execute("zb.run(n_values=(1, 2, 4, 8), stages=(0, 1, 2, 3), dtypes=('fp32', 'bf16'))")
        t0 = time.monotonic()
        while not (ranks := _workers(kernel.pid)) and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        assert ranks, "the cell's world never started"
        time.sleep(1.0)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == cell
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert _gone(ranks, within_s=KILL_GUARD_S) is not None, "the interrupted cell's ranks live on"
        # the kernel lives on. ipykernel answers 'aborted' to a cell that reaches it while it is still aborting the
        # queue behind the failed cell (what stops Run All after an error); a client this fast can land in that
        # window (CI, stop 20), so such a cell is sent again, at most twice
        for _ in range(3):
            status = kc.execute_interactive(small, timeout=120)["content"]["status"]
            if status != "aborted":
                break
            time.sleep(0.5)
        assert status == "ok"
        warm = _workers(kernel.pid)
        assert len(warm) == 2
        km.shutdown_kernel(now=True)
        assert _gone(warm, within_s=KILL_GUARD_S) is not None, "warm ranks outlived their kernel"
    finally:
        km.shutdown_kernel(now=True)
