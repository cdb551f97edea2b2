"""The matrix's cells on a local Dask cluster (``gradkit.commands.check.matrix``), with each cell's task replaced by a
function Dask's worker can import (``dict``: the cell back as it went): one worker process with one thread (a cell is
a world of its own ranks: two at once would share the cores), results in the cells' order whatever order they come
back in, two equal cells run twice, and the cluster gone after; and one cell (``gradkit.commands.check.task``): bad
input refused before any launch, a checked one's ranks kept for the next cell of its stack. The real cells on that
cluster: test_check_corpus.py."""
import contextlib
import os
import types

from gradkit.commands.check import matrix


def test_the_local_cluster_runs_one_cell_at_a_time_in_a_process_of_its_own_and_returns_them_in_order(monkeypatch):
    made = []

    def client_for(scheduler):
        client, cluster = real(scheduler)
        workers = client.scheduler_info()["workers"].values()
        made.append((client, cluster, [w["nthreads"] for w in workers], list(client.run(os.getpid).values())))
        return client, cluster

    real = matrix.client_for
    monkeypatch.setattr(matrix, "client_for", client_for)
    monkeypatch.setattr(matrix, "task", types.SimpleNamespace(check_task=dict))
    cells = [{"cell": 1}, {"cell": 2}, {"cell": 1}, {"cell": 3}]  # two equal cells: each its own run
    said = []
    assert matrix.run(cells, "dask", said.append) == cells
    assert sorted(said, key=str) == sorted(cells, key=str)
    ((client, cluster, threads, pids),) = made
    assert threads == [1] and len(pids) == 1 and pids != [os.getpid()]  # one worker of one thread, a process apart
    assert cluster.status.name == "closed" and client.status == "closed"


def test_a_cell_refused_before_its_launch_is_bad_input_exit_2_and_a_checked_one_keeps_its_ranks_and_its_time(
        monkeypatch, tmp_path):
    from gradkit.commands.check import task

    bad = tmp_path / "broken.json"
    bad.write_text("{ not json")
    cell = {"source": str(bad), "command": None, "release": "0.18.6", "args": {"model": None, "adapter": None}}
    out = task.check_task(cell)
    assert out["verdict"] == task.BAD_INPUT and out["exit"] == 2 and out["release"] == "0.18.6"
    assert out["source"] == str(bad) and out["error"] and out["precisions"] == {}

    kept, clock = [], iter([10.0, 12.3456])
    monkeypatch.setattr(task, "prepare", lambda t: ("run", None, "a", "model"))
    monkeypatch.setattr(task.paths, "check", lambda run, a, say: say("judged") or {"source": "s", "verdict": "v"})
    monkeypatch.setattr(task.launch, "warm_worlds", lambda keep: kept.append(keep) or contextlib.nullcontext())
    monkeypatch.setattr(task.time, "perf_counter", lambda: next(clock))
    out = task.check_task({**cell, "source": None})
    assert out == {"source": "s", "verdict": "v", "release": "0.18.6", "log": ["judged"], "wall_s": 2.35}
    assert kept == [True]  # the next cell of the same stack in this process finds its ranks up
