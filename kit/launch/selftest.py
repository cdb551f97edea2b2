"""Tiny rank functions that check the launcher itself: one that answers, one that raises, one that hangs.

    python -m gradkit.launch.selftest          # a 2-rank world answers: the set-up works
"""
from __future__ import annotations

import os
import time

from gradkit.judge import oracle
from gradkit.probes.ranks import common
from gradkit.probes.ranks import judging


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
    return {"rank": dist.get_rank(), "pid": os.getpid()}


def hang_on_rank(payload: dict) -> dict:
    """Rank ``payload['rank']`` sleeps far past any sensible timeout."""
    import torch.distributed as dist

    if dist.get_rank() == payload["rank"]:
        time.sleep(payload.get("seconds", 3600))
    return {"rank": dist.get_rank(), "pid": os.getpid()}


if __name__ == "__main__":
    from gradkit import launch

    t0 = time.time()
    out = launch.run_world("gradkit.launch.selftest:ping", {"echo": "ok"}, world_size=2, init="deepspeed")
    print(f"2-rank DeepSpeed world answered in {time.time() - t0:.1f} s: {out}")


def cases_then_desync(payload: dict) -> list:
    """Cases through ``run_cases``: the first succeeds everywhere, in the second rank 1 raises while
    rank 0 waits in a collective that rank 1 will never join (the asymmetric failure of a real probe)."""
    import torch
    import torch.distributed as dist

    def one(case):
        if case["name"] == "desync" and dist.get_rank() == 1:
            raise RuntimeError("only rank 1 fails here")
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"sum": t.item()}

    return judging.run_cases(payload, one)


def abort_after_result(payload: dict) -> dict:
    """Rank ``payload['rank']`` answers, then aborts (SIGABRT) in tear-down: its ``destroy_process_group``, which the
    worker calls once the result is on disk, is replaced by an abort (``payload['before']``: it aborts before
    answering). No timing is involved: a thread that watched for the result file lost the race to a normal exit
    under load; the barrier first makes sure both ranks are through joining the group."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == payload["rank"] and payload.get("before"):
        os.abort()
    dist.barrier()  # gloo may be through one rank's side of its connection mesh before the other's: an abort then
    # fails the other rank in joining the group, not in tear-down (seen once, rank 1: "connectFullMesh failed")
    if rank == payload["rank"]:
        dist.destroy_process_group = lambda *args, **kwargs: os.abort()
    return {"rank": rank}


def judge_with_rank_offset(payload: dict) -> dict:
    """Every rank hands ``gradkit.probes.ranks.common.judge`` the reference step of a tiny MLP, rank r's moved by
    ``payload['offset'] * r`` (relative): the rank agreement the oracle reports for ranks that disagree (or not)."""
    import torch

    seed, ga, mb, hidden = 0, 2, 4, 8
    model = common.tiny_mlp(hidden, seed, 2)
    every = [b for r in range(common.world_size()) for b in common.micro_batches(seed, r, ga, mb, hidden)]
    _, _, reference = oracle.reference_gradients(model, every, common.mse)
    effective = reference * (1.0 + payload["offset"] * common.rank())
    out, *_ = judging.judge(effective, model if common.rank() == 0 else None, seed, ga, mb, hidden)
    return {"rank": common.rank(), "rank_spread": out.get("rank_spread"), "finite": bool(torch.isfinite(effective).all())}
