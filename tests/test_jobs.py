"""A user's script under torchrun with its ranks forked from a job server (``gradkit.launch.jobs``): each rank is the
script as ``python -u script.py`` runs it (its arguments, folder, path, environment, streams, exit, random state), a
rank whose launch times out dies at once, and a server that cannot fork or is gone costs only the fresh interpreters
torchrun would have started."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from gradkit.launch import cleanup, jobs, scripts

pytestmark = pytest.mark.world

SCRIPT = """\
import json, os, random, sys, threading
import torch
rank = int(os.environ["RANK"])
sys.stdout.write(json.dumps({"rank": rank, "name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
                  "env": os.environ.get("MY_SETTING"), "torch_seed": torch.initial_seed(), "torch_rand": torch.rand(1).item(),
                  "random": random.random(), "pid": os.getpid(), "parent": os.getppid()}) + "\\n")  # one write: ranks share the pipe
sys.stderr.write(f"rank {rank} on stderr\\n")
threading.Thread(target=lambda: print(f"rank {rank}: a thread the interpreter waits for", flush=True)).start()
if sys.argv[1] == "raise" and rank == 1:
    raise RuntimeError("the user's own error")
sys.exit(int(sys.argv[2]))
"""


def _servers() -> list:
    """This process's job servers now (one that has left and is not yet reaped is not one)."""
    out = []
    for p in psutil.Process().children():
        try:
            if "gradkit.launch.jobserver" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _run(tmp_path, *args, warm: bool, monkeypatch, timeout_s=120):
    monkeypatch.setenv(jobs.WARM_JOBS_ENV, "1" if warm else "0")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    rc, out, err = scripts.torchrun(script, list(args), packages=(), env={"MY_SETTING": "set"}, timeout_s=timeout_s)
    said = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda d: d["rank"])
    return rc, said, out, err


def test_a_forked_rank_is_the_script_as_a_fresh_interpreter_runs_it(tmp_path, monkeypatch):
    fresh = _run(tmp_path, "exit", "0", warm=False, monkeypatch=monkeypatch)
    warm = _run(tmp_path, "exit", "0", warm=True, monkeypatch=monkeypatch)
    again = _run(tmp_path, "exit", "0", warm=True, monkeypatch=monkeypatch)
    assert fresh[0] == warm[0] == again[0] == 0, (warm[3][-2000:], fresh[3][-2000:])
    servers = {p.pid for p in _servers()}
    parents = {d["parent"] for d in warm[1] + again[1]}
    assert len(parents) == 1 and parents <= servers  # forked, all four, by one server
    assert not any(d["parent"] in servers for d in fresh[1])
    for f, w in zip(fresh[1], warm[1]):
        for key in ("rank", "name", "argv", "cwd", "path0", "env"):
            assert f[key] == w[key], key
    for key in ("random", "torch_seed", "torch_rand"):  # seeded from the OS, as in a fresh interpreter
        assert len({d[key] for d in fresh[1] + warm[1] + again[1]}) == 6, key
    for out, err in ((warm[2], warm[3]), (again[2], again[3])):
        assert out.count("a thread the interpreter waits for") == 2 and "rank 0 on stderr" in err


@pytest.mark.parametrize("args, code", [(("exit", "3"), 1), (("raise", "0"), 1)], ids=["exit-3", "raise"])
def test_a_forked_ranks_failure_is_torchruns_as_a_fresh_ones(tmp_path, monkeypatch, args, code):
    fresh = _run(tmp_path, *args, warm=False, monkeypatch=monkeypatch)
    warm = _run(tmp_path, *args, warm=True, monkeypatch=monkeypatch)
    assert fresh[0] == warm[0] == code, (fresh[3][-3000:], warm[3][-3000:])
    if args[0] == "raise":
        for err in (fresh[3], warm[3]):
            assert 'raise RuntimeError("the user\'s own error")' in err and "RuntimeError: the user's own error" in err, err
            # the script's frames only, as the interpreter shows them
            assert f'Traceback (most recent call last):\n  File "{tmp_path / "job.py"}", line 10, in <module>' in err
            assert "jobserver" not in err
    else:
        assert "exitcode  : 3" in warm[3] and "exitcode  : 3" in fresh[3]


def test_a_launch_past_its_timeout_takes_its_forked_ranks_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(jobs.WARM_JOBS_ENV, "1")
    script = tmp_path / "hang.py"
    script.write_text("import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n")
    t0 = time.monotonic()
    rc, out, _ = scripts.torchrun(script, packages=(), timeout_s=10)
    assert rc == 124 and time.monotonic() - t0 < 120  # a hang guard (it returns in ~11 s), not a speed target
    pids = [int(line) for line in out.split() if line.isdigit()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a forked rank outlived its launch's timeout"
        time.sleep(0.1)


def test_a_server_that_is_gone_or_cannot_fork_leaves_fresh_interpreters(tmp_path, monkeypatch):
    monkeypatch.setenv(jobs.WARM_JOBS_ENV, "1")
    jobs.stop_job_servers()
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint('ran', os.getppid(), 'deepspeed' in sys.modules, flush=True)\n")
    # an import the ranks meet themselves: the server answers that it cannot fork, the ranks start fresh
    rc, out, _ = scripts.torchrun(script, packages=("no_such_package_here",), timeout_s=120)
    assert rc == 0 and out.count("ran") == 2 and "True" not in out
    servers = _servers()
    assert len(servers) == 1  # stopped above: this launch's
    parents = {int(line.split()[1]) for line in out.splitlines() if line.startswith("ran")}
    assert servers[0].pid not in parents
    servers[0].kill()  # gone: the next launch starts another
    servers[0].wait(10)
    rc, out, _ = scripts.torchrun(script, packages=("deepspeed",), timeout_s=120)
    assert rc == 0 and out.count("ran") == 2 and out.count("True") == 2
    jobs.stop_job_servers()
    assert not _servers()


def test_a_job_servers_folder_outlives_neither_its_server_nor_its_caller(tmp_path, monkeypatch):
    """A caller and its server both killed with SIGKILL (neither ran its clean-up) leave the server's folder, its
    socket and the caller's claim on it: the next world's start (``remove_stale_worlds``) removes it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the folders the sweep looks at: this test's
    code = ("import os, sys\nfrom gradkit.launch import jobs\nos.environ[jobs.WARM_JOBS_ENV] = '1'\n"
            "cmd = jobs.client_command(dict(os.environ), (), 'cpu')\nprint(cmd[-2], cmd[-1], flush=True)\n"
            "sys.stdin.read()\n")
    caller = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    sock, pid = caller.stdout.readline().split()
    folder = Path(sock).parent
    assert folder.parent == tmp_path and folder.name.startswith("gradkit-jobs-")
    assert cleanup.remove_stale_worlds() == [] and folder.exists()  # its caller alive: kept
    os.kill(int(pid), signal.SIGKILL)
    caller.kill()
    caller.wait(10)
    assert folder.exists()
    assert cleanup.remove_stale_worlds() == [folder] and not folder.exists()
