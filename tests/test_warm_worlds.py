"""Warm worlds (``gradkit.launch.warm_worlds``): the explorer's ranks stay up between Runs. The same answers as fresh
worlds, one set of ranks for job after job, and a failure, an idle limit or a stop never leaves a rank behind."""
import threading
import time

import psutil
import pytest

from gradkit import launch, probes
from gradkit.notebooks import explore
from gradkit.probes import runner
from gradkit.probes import zero_boundary as zb

pytestmark = pytest.mark.world


def _pids(result):
    return sorted(r["pid"] for r in result)


@pytest.fixture(autouse=True)
def no_warm_world_left():
    yield
    launch.stop_warm_worlds(servers=False)  # the fork servers stay for the next test's worlds, as in a kernel


def _metrics(recs):
    return [(r["case"], r["ga"], r.get("dtype"), r["verdict"], r.get("metrics")) for r in recs]


def test_job_after_job_in_one_warm_world_gives_the_answers_of_fresh_worlds():
    """B3 twice in the same two ranks, and B2 then B4 each in a warm world of its own (a warm world serves one probe:
    B2's pipeline topology, left in ranks that then ran B4, broke it): every record as a fresh world's, and a later
    job skips the start-up (the ranks' imports, init_distributed and torch._dynamo's import)."""
    runs = {bug: explore.probe_call(explore.default_selection(bug))[1] for bug in ("B2", "B3", "B4")}
    fresh = {bug: _metrics(probes.get(bug).run(**kw)) for bug, kw in runs.items()}
    world, _ = runner.world_for(zb.PROBE, {}, 2, "cpu", 300)  # the world the B3 runs ask for
    with launch.warm_worlds():
        first = _metrics(zb.run(**runs["B3"]))
        ranks = {k: [p.pid for p in w.procs] for k, w in launch.warm._WARM.items()}
        again = _metrics(zb.run(**runs["B3"]))
        assert {k: [p.pid for p in w.procs] for k, w in launch.warm._WARM.items()} == ranks  # the same ranks served it
        b2, b4 = (_metrics(probes.get(bug).run(**runs[bug])) for bug in ("B2", "B4"))
        assert len(launch.warm._WARM) == launch.WARM_MAX  # B3's went when B4's came (least recently used)
    assert first == again == fresh["B3"] and b2 == fresh["B2"] and b4 == fresh["B4"]
    assert all(r[3] != "cannot-run" for r in b2 + b4)
    # how much faster the warm run is is a speed goal: scripts/bench.py --profile (explorer Run, warm world)
    assert world.world_size == 2


def test_one_warm_world_per_target_and_never_more_than_warm_max():
    w = launch.World(world_size=2, init="torch", timeout_s=60)
    with launch.warm_worlds():
        a1 = _pids(launch.run_world("gradkit.launch.selftest:ping", {}, w))
        a2 = _pids(launch.run_world("gradkit.launch.selftest:ping", {"echo": 1}, w))
        b = _pids(launch.run_world("gradkit.launch.selftest:hang_on_rank", {"rank": -1}, w))  # nobody hangs
        assert a1 == a2 and not set(a1) & set(b)  # same target: same ranks; another target: its own
        c = _pids(launch.run_world("gradkit.launch.selftest:ping", {}, launch.World(world_size=1, init="torch", timeout_s=60)))
    assert len(launch.warm._WARM) == launch.WARM_MAX == 2
    assert not [p for p in a1 if psutil.pid_exists(p)]  # the least recently used went
    assert all(psutil.pid_exists(p) for p in b + c)


def test_a_failing_job_takes_its_warm_world_down_and_the_next_call_starts_a_new_one():
    with launch.warm_worlds():
        ok = {"rank": -1}  # nobody fails
        first = _pids(launch.run_world("gradkit.launch.selftest:fail_on_rank", ok, world_size=2, init="torch", timeout_s=60))
        with pytest.raises(launch.RankFailed, match="needle-7") as e:
            launch.run_world("gradkit.launch.selftest:fail_on_rank", {"rank": 1, "message": "needle-7"}, world_size=2,
                             init="torch", timeout_s=60)
        assert e.value.rank == 1
        assert not [p for p in first if psutil.pid_exists(p)], "the failed warm world's ranks live on"
        second = _pids(launch.run_world("gradkit.launch.selftest:fail_on_rank", ok, world_size=2, init="torch", timeout_s=60))
    assert not set(first) & set(second)


def test_a_warm_world_outlives_the_thread_that_started_it_but_not_its_idle_limit(monkeypatch):
    """The parent-death signal follows the thread that started a process: a warm world started from a Run's
    thread must not die with it. Idle past ``WARM_IDLE_S``, its ranks leave by themselves, and their fork server
    (a whole stack in memory: a kernel keeps its worlds warm between cells) ``SERVER_IDLE_S`` later."""
    monkeypatch.setattr(launch.warm, "WARM_IDLE_S", 3.0)  # read where they are defined, not on the package
    monkeypatch.setattr(launch.servers, "SERVER_IDLE_S", 1.0)
    launch.stop_warm_worlds()  # a server of an earlier test has the usual idle limit: this world gets a new one
    got = {}

    def run():
        with launch.warm_worlds():
            got["pids"] = _pids(launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, init="torch", timeout_s=60))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    time.sleep(1.0)
    procs = [psutil.Process(p) for p in got["pids"]]
    assert all(p.is_running() for p in procs), "the warm world died with the thread that started it"
    gone, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, "idle ranks stayed past their limit"
    servers = [s.proc for s in launch.servers._SERVERS.values() if s is not None]
    assert len(servers) == 1 and servers[0].wait(timeout=15) == 0, "the idle fork server stayed"
    with launch.warm_worlds():  # the next call notices and starts a new world
        assert not set(got["pids"]) & set(_pids(launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2,
                                                                  init="torch", timeout_s=60)))


def test_stopping_the_warm_worlds_kills_their_ranks():
    with launch.warm_worlds():
        pids = _pids(launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, init="torch", timeout_s=60))
    assert launch.stop_warm_worlds() == 1
    assert not psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)[1]
