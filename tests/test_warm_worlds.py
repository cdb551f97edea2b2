"""Warm worlds (``kit.launch.warm_worlds``): the explorer's ranks stay up between Runs. The same answers as fresh
worlds, one set of ranks for job after job, and a failure, an idle limit or a stop never leaves a rank behind."""
import threading
import time

import psutil
import pytest

from kit import explore, launch, runner
from kit.probes import bf16_leak, zero_boundary as zb

pytestmark = pytest.mark.world


def _pids(result):
    return sorted(r["pid"] for r in result)


@pytest.fixture(autouse=True)
def no_warm_world_left():
    yield
    launch.stop_warm_worlds()


def _metrics(recs):
    return [(r["case"], r["ga"], r.get("dtype"), r["verdict"], r.get("metrics")) for r in recs]


def test_job_after_job_in_one_warm_world_gives_the_answers_of_fresh_worlds():
    """B3 then B4 then B3 again in the same two ranks (one installed stack): every record as a fresh world's, and
    the later jobs skip the start-up (the ranks' imports, init_distributed and torch._dynamo's import)."""
    _, b3 = explore.probe_call(explore.default_selection("B3"))
    b4 = dict(world_size=2, ga_values=(4,), cases=("leak", "workaround", "control"))
    fresh = _metrics(zb.run(**b3)), _metrics(bf16_leak.run(**b4))
    world, _ = runner.world_for(zb.PROBE, {}, 2, "cpu", 300)  # the world the probes' runs ask for
    with launch.warm_worlds():
        before = _pids(launch.run_world("kit.selftest:ping", {}, world))  # starts it
        t0 = time.monotonic()
        warm_b3 = _metrics(zb.run(**b3))
        warm_b3_s = time.monotonic() - t0
        warm_b4 = _metrics(bf16_leak.run(**b4))
        again = _metrics(zb.run(**b3))
        after = _pids(launch.run_world("kit.selftest:ping", {}, world))
    assert (warm_b3, warm_b4) == fresh and again == fresh[0]
    assert before == after  # the same two processes ran every job
    assert warm_b3_s < 3.0, f"a warm B3 run took {warm_b3_s:.1f} s"  # fresh: ~7 s on 2 cores


def test_a_failing_job_takes_its_warm_world_down_and_the_next_call_starts_a_new_one():
    with launch.warm_worlds():
        first = _pids(launch.run_world("kit.selftest:ping", {}, world_size=2, init="torch", timeout_s=60))
        with pytest.raises(launch.RankFailed, match="needle-7") as e:
            launch.run_world("kit.selftest:fail_on_rank", {"rank": 1, "message": "needle-7"}, world_size=2,
                             init="torch", timeout_s=60)
        assert e.value.rank == 1
        assert not [p for p in first if psutil.pid_exists(p)], "the failed warm world's ranks live on"
        second = _pids(launch.run_world("kit.selftest:ping", {}, world_size=2, init="torch", timeout_s=60))
    assert not set(first) & set(second)


def test_a_warm_world_outlives_the_thread_that_started_it_but_not_its_idle_limit(monkeypatch):
    """The parent-death signal follows the thread that started a process: a warm world started from a Run's
    thread must not die with it. Idle past ``WARM_IDLE_S``, its ranks leave by themselves."""
    monkeypatch.setattr(launch, "WARM_IDLE_S", 4.0)
    got = {}

    def run():
        with launch.warm_worlds():
            got["pids"] = _pids(launch.run_world("kit.selftest:ping", {}, world_size=2, init="torch", timeout_s=60))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    time.sleep(1.0)
    procs = [psutil.Process(p) for p in got["pids"]]
    assert all(p.is_running() for p in procs), "the warm world died with the thread that started it"
    gone, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, "idle ranks stayed past their limit"
    with launch.warm_worlds():  # the next call notices and starts a new world
        assert not set(got["pids"]) & set(_pids(launch.run_world("kit.selftest:ping", {}, world_size=2,
                                                                  init="torch", timeout_s=60)))


def test_stopping_the_warm_worlds_kills_their_ranks():
    with launch.warm_worlds():
        pids = _pids(launch.run_world("kit.selftest:ping", {}, world_size=2, init="torch", timeout_s=60))
    assert launch.stop_warm_worlds() == 1
    assert not psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)[1]
