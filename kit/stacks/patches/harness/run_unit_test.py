"""Run a patch's regression test (written for DeepSpeed's ``tests/unit`` tree) in a torchrun world: every rank runs
the same tests in the same order under pytest, so their collectives meet; rank 0 prints pytest's report. The exit
status is pytest's (torchrun's is non-zero where any rank's is).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 run_unit_test.py b10_test.py
"""
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ``unit.common``: this folder's stand-in for DeepSpeed's
rank = int(os.environ.get("RANK", "0"))
os.chdir(Path(sys.argv[1]).resolve().parent)  # pytest names the test by its file alone
args = [sys.argv[1], "-c", os.devnull, "-p", "no:cacheprovider", "--color=no",
        "--rootdir", str(Path(sys.argv[1]).parent),
        *(["-q", "--no-header", "-rA"] if rank == 0 else ["-qq", "--no-summary"])]
if rank != 0:
    sys.stdout = open(os.devnull, "w")
rc = int(pytest.main(args))
if dist.is_available() and dist.is_initialized():  # every rank done (rank 0's report printed) before any exits: a
    status = torch.tensor([rc])                   # rank leaving first with 1 would have torchrun kill the others
    dist.all_reduce(status, op=dist.ReduceOp.MAX)
    rc = int(status.item())
sys.exit(rc)
