"""Tiny rank functions that check the launcher itself: one that answers, one that raises, one that hangs.

    python -m kit.selftest          # a 2-rank world answers: the set-up works
"""
from __future__ import annotations

import os
import time


def ping(payload: dict) -> dict:
    """Every rank reports who it is and the sum of all ranks (a real collective)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "rank_sum": t.item(),
            "echo": payload.get("echo"), "pid": os.getpid()}


def fail_on_rank(payload: dict) -> dict:
    """Rank ``payload['rank']`` raises; the others wait in a collective that will never complete."""
    import torch.distributed as dist

    if dist.get_rank() == payload["rank"]:
        raise ValueError(f"deliberate failure on rank {payload['rank']}: {payload.get('message', '')}")
    dist.barrier()
    return {"rank": dist.get_rank()}


def hang_on_rank(payload: dict) -> dict:
    """Rank ``payload['rank']`` sleeps far past any sensible timeout."""
    import torch.distributed as dist

    if dist.get_rank() == payload["rank"]:
        time.sleep(payload.get("seconds", 3600))
    return {"rank": dist.get_rank()}


if __name__ == "__main__":
    from kit import launch

    t0 = time.time()
    out = launch.run_world("kit.selftest:ping", {"echo": "ok"}, world_size=2, init="deepspeed")
    print(f"2-rank DeepSpeed world answered in {time.time() - t0:.1f} s: {out}")


def cases_then_desync(payload: dict) -> list:
    """Cases through ``run_cases``: the first succeeds everywhere, in the second rank 1 raises while
    rank 0 waits in a collective that rank 1 will never join (the asymmetric failure of a real probe)."""
    import torch
    import torch.distributed as dist

    from kit.probes import common

    def one(case):
        if case["name"] == "desync" and dist.get_rank() == 1:
            raise RuntimeError("only rank 1 fails here")
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"sum": t.item()}

    return common.run_cases(payload, one)


def abort_after_result(payload: dict) -> dict:
    """Rank ``payload['rank']`` answers, then aborts (SIGABRT) once its result is on disk: a crash in tear-down
    (``payload['before']``: it aborts before answering)."""
    import signal
    import threading
    from pathlib import Path

    import torch.distributed as dist

    from kit import worker

    rank = dist.get_rank()
    if rank == payload["rank"] and payload.get("before"):
        os.abort()
    if rank == payload["rank"]:
        done = Path(os.environ[worker.PARTIAL_ENV]).with_name(f"rank{rank}.json")

        def abort_when_written():
            while not done.exists():
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGABRT)
            time.sleep(60)  # the signal ends the process; never return into a normal exit

        threading.Thread(target=abort_when_written, daemon=True).start()
    return {"rank": rank}
