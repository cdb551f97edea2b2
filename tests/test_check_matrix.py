"""The matrix's cells on a local Dask cluster (``gradkit.commands.check.matrix``), with each cell's task replaced by a
function Dask's worker can import (``dict``: the cell back as it went): one worker process with one thread (a cell is
a world of its own ranks: two at once would share the cores), results in the cells' order whatever order they come
back in, two equal cells run twice, and the cluster gone after. The real cells on that cluster: test_check_corpus.py."""
import os
import types

from gradkit.commands.check import matrix


def test_the_local_cluster_runs_one_cell_at_a_time_in_a_process_of_its_own_and_returns_them_in_order(monkeypatch):
    made = []

    def client_for(scheduler):
        client, cluster = real(scheduler)
        made.append((client, cluster))
        return client, cluster

    real = matrix.client_for
    monkeypatch.setattr(matrix, "client_for", client_for)
    monkeypatch.setattr(matrix, "task", types.SimpleNamespace(check_task=dict))
    cells = [{"cell": 1}, {"cell": 2}, {"cell": 1}, {"cell": 3}]  # two equal cells: each its own run
    said = []
    assert matrix.run(cells, "dask", said.append) == cells
    assert sorted(said, key=str) == sorted(cells, key=str)
    ((client, cluster),) = made
    assert cluster.status.name == "closed" and client.status == "closed"

    client, cluster = real("dask")
    try:
        workers = client.scheduler_info()["workers"].values()
        assert [w["nthreads"] for w in workers] == [1]
        assert list(client.run(os.getpid).values()) != [os.getpid()]  # a process of its own
    finally:
        client.close()
        cluster.close()
