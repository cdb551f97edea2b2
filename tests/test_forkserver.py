"""Fork servers (``gradkit.launch.forkserver``): a probe run forks the ranks of all its worlds of one stack from one
process that imported the stack once, and the server stays for the next run of that stack. The same measurements as
ranks started one by one, and the ranks still die with their caller."""
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from gradkit import launch
from gradkit.probes import runner
from gradkit.probes import zero_boundary as zb

pytestmark = pytest.mark.world


def _run_and_watch(world_sizes=(1, 2), n_values=(1, 4)):
    """B3 at ``world_sizes`` (by default 1 and 2: two worlds of one stack); the ranks seen, and their parents' pid
    and command line, while it ran."""
    seen = {}

    def look(event):
        if event["kind"] == "case":
            for rank, p in launch.ranks_below(os_pid()):
                try:
                    seen[p.pid] = (p.ppid(), " ".join(p.parent().cmdline()))
                except psutil.Error:
                    pass

    with runner.listen(look):
        recs = zb.run(world_sizes=world_sizes, n_values=n_values, stages=(2,), dtypes=("fp32",), fixes=(), timeout_s=300)
    return recs, seen


def os_pid():
    import os

    return os.getpid()


def test_a_probe_run_forks_its_worlds_from_one_server_and_measures_the_same(monkeypatch):
    recs, seen = _run_and_watch()
    assert len(seen) == 3 and all("gradkit.launch.forkserver" in cmd for _, cmd in seen.values()), seen  # 1 + 2 ranks
    (server,) = {ppid for ppid, _ in seen.values()}
    assert not [p for _, p in launch.ranks_below(os_pid()) if p.ppid() == server], "a rank outlived its run"
    assert psutil.pid_exists(server), "the server did not stay for the next run of its stack"
    _, again = _run_and_watch(world_sizes=(2,), n_values=(1,))
    assert again and {ppid for ppid, _ in again.values()} == {server}  # no second import of the stack
    monkeypatch.setenv(launch.NO_FORK_ENV, "1")
    started, seen = _run_and_watch()
    assert seen and not any("gradkit.launch.forkserver" in cmd for _, cmd in seen.values())
    key = lambda r: (r["world_size"], r["case"], r["ga"])  # noqa: E731
    assert [(key(r), r["verdict"], r["metrics"]) for r in sorted(recs, key=key)] == \
        [(key(r), r["verdict"], r["metrics"]) for r in sorted(started, key=key)]
    assert {r["verdict"] for r in recs} == {"affected", "not-affected"}  # ZeRO-2 at N=4 is B3; N=1 is not


def test_forked_ranks_and_their_server_die_within_seconds_when_the_caller_is_killed():
    caller = subprocess.Popen([sys.executable, "-c", (
        "from gradkit import launch\n"
        "with launch.warm_worlds():\n"
        "    launch.run_world('gradkit.launch.selftest:hang_on_rank', {'rank': 0, 'seconds': 600}, world_size=2, init='torch',"
        " timeout_s=600)\n")], cwd=str(launch.REPO_ROOT))
    deadline, ranks = time.monotonic() + 60, []
    while len(ranks) < 2 and time.monotonic() < deadline:
        ranks = [p for r, p in launch.ranks_below(caller.pid) if r >= 0]
        time.sleep(0.1)
    assert len(ranks) == 2, "the warm world's ranks never came up"
    tree = psutil.Process(caller.pid).children(recursive=True)
    assert any("gradkit.launch.forkserver" in " ".join(p.cmdline()) for p in tree)
    mine = [f for f in Path(tempfile.gettempdir()).glob("gradkit-world-*")
            if (f / launch.OWNER_FILE).exists() and (f / launch.OWNER_FILE).read_text().split()[0] == str(caller.pid)]
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    gone, alive = psutil.wait_procs(tree, timeout=30.0)  # a hang guard: they go within a second or two
    assert not alive, f"outlived their caller by 30 s: {[p.pid for p in alive]}"
    # the killed caller never removed its warm world's folder: the next launch does (gradkit.launch.remove_stale_worlds)
    launch.remove_stale_worlds()  # (another test's launch, on the other xdist worker, may have done it first)
    assert len(mine) == 1 and not mine[0].exists()


WARMED = """
import sys, torch, torch.distributed as tdist
from gradkit.launch import worker
worker.warm_up("deepspeed")  # in a fork server: no process group yet
before = set(sys.modules)
tdist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
import deepspeed
deepspeed.init_distributed("gloo")
from deepspeed.runtime.zero import utils
utils.is_zero_supported_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
print(sorted(m for m in set(sys.modules) - before if m.startswith(("deepspeed.runtime", "torch._inductor"))))
"""


@pytest.mark.skipif(not launch.installed_key().startswith("deepspeed-0.19"), reason="the Muon module is 0.19's")
def test_what_a_ranks_first_zero_optimizer_check_imports_is_imported_by_the_server_before_it_forks():
    """DeepSpeed 0.19 imports its Muon optimizer (which torch.compiles at import: torch._inductor, ~1.4 s of a core)
    inside the first ``initialize``'s optimizer check, after asking the process group its rank. The server's warm-up
    has no group: it imports the optimizers ZeRO knows itself, or every forked rank pays them again."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**launch.rank_env(launch.World(world_size=1), 0, port)}
    out = subprocess.run([sys.executable, "-c", WARMED, str(port)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
