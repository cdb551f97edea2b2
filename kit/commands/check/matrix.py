"""The cells of ``gradkit check``'s matrix (configs x DeepSpeed releases) on a Dask cluster:
``--scheduler dask`` starts a local one (one worker process, one cell at a time: each cell is a world of its own
ranks), ``--scheduler tcp://host:8786`` uses yours (start ``dask scheduler`` and a ``dask worker`` per machine,
each with the kit installed; a worker runs one cell at a time with ``--nthreads 1``).

Each cell is ``gradkit.commands.check.task.check_task`` on plain data, the same function ``--scheduler here`` runs in
this process, so a cell's result does not depend on where it ran; a worker keeps a stack's ranks up between the
cells it runs (warm worlds) and they go with it.
"""
from __future__ import annotations

from dask.distributed import Client, LocalCluster, as_completed

import gradkit.commands.check.task as task


def client_for(scheduler: str) -> tuple[Client, LocalCluster | None]:
    """A client of the cluster ``scheduler`` names (``dask``: a local cluster, started here)."""
    if scheduler == "dask":
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None)
        return Client(cluster), cluster
    return Client(scheduler), None


def run(cells: list[dict], scheduler: str, said) -> list[dict]:
    """Every cell on the cluster; ``said(result)`` as each comes back; the results in the cells' order."""
    client, cluster = client_for(scheduler)
    try:
        futures = client.map(task.check_task, cells, pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        out: list = [None] * len(cells)
        for future in as_completed(futures):
            out[index[future.key]] = future.result()
            said(out[index[future.key]])
        return out
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
