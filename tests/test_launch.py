"""The launcher on real 2-rank gloo worlds: results come back, a raising rank is named, a hung rank is killed."""
import os
import tempfile
import time

import pytest

from gradkit import launch
from gradkit.stacks import versions

pytestmark = pytest.mark.world


def test_every_rank_answers_through_a_real_collective():
    out = launch.run_world("gradkit.launch.selftest:ping", {"echo": 7}, world_size=2, init="torch", timeout_s=60)
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["rank_sum"] == 1.0 and r["world_size"] == 2 and r["echo"] == 7 for r in out)
    assert out[0]["pid"] != out[1]["pid"]


def test_deepspeed_world_answers():
    out = launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, init="deepspeed", timeout_s=300)
    assert [r["rank_sum"] for r in out] == [1.0, 1.0]


def test_a_raising_rank_surfaces_its_traceback():
    t0 = time.time()
    with pytest.raises(launch.RankFailed) as e:
        launch.run_world("gradkit.launch.selftest:fail_on_rank", {"rank": 1, "message": "needle-42"}, world_size=2,
                         init="torch", timeout_s=60)
    assert e.value.rank == 1
    assert "needle-42" in str(e.value) and "Traceback" in e.value.traceback and "fail_on_rank" in e.value.traceback
    assert time.time() - t0 < 60  # a hang guard: the other rank, stuck in a barrier, is killed after a short grace


def test_a_hung_rank_is_killed_within_its_timeout():
    t0 = time.time()
    with pytest.raises(launch.RankTimeout) as e:
        launch.run_world("gradkit.launch.selftest:hang_on_rank", {"rank": 0}, world_size=2, init="torch", timeout_s=8)
    elapsed = time.time() - t0
    assert 8 <= elapsed < 90, elapsed  # not before its timeout; the upper bound only catches a hang (10x)
    assert e.value.rank == 0 and "timeout of 8 s" in str(e.value)


def test_a_missing_target_is_a_failure_not_a_hang():
    with pytest.raises(launch.RankFailed, match="no_such_function"):
        launch.run_world("gradkit.launch.selftest:no_such_function", {}, world_size=2, init="torch", timeout_s=60)


def test_an_unknown_release_is_refused_before_launch():
    with pytest.raises(versions.UnknownVersion, match="0.0.999"):
        versions.resolve_stack({"deepspeed": "0.0.999"})


def test_a_case_failing_on_one_rank_stops_the_world_and_keeps_the_finished_cases():
    cases = [{"name": "fine", "ga": 1}, {"name": "desync", "ga": 1}, {"name": "never", "ga": 1}]
    t0 = time.time()
    with pytest.raises(launch.RankFailed) as e:
        launch.run_world("gradkit.launch.selftest:cases_then_desync", {"cases": cases}, world_size=2, init="torch",
                         timeout_s=120, env={"GRADKIT_SYNC_TIMEOUT_S": "5"})
    assert time.time() - t0 < 60  # found by the monitored barrier, long before the world's timeout
    assert "WorldDesynchronised" in str(e.value) and "only rank 1 fails here" in str(e.value)
    assert [p["case"] for p in e.value.partial[0]] == ["fine"] and e.value.partial[0][0]["sum"] == 2.0


def test_records_keep_finished_cases_and_mark_the_rest_cannot_run(monkeypatch):
    from gradkit.judge import oracle
    from gradkit.probes import runner
    from gradkit.probes import bf16_leak

    def stopped(*a, **k):
        raise launch.RankFailed("rank 1 raised WorldDesynchronised: case 'b' ...", rank=1,
                                partial={0: [{"case": "a", "ga": 1, "metrics": None, "error": "boom", "versions": {}}]})

    monkeypatch.setattr(launch, "run_world", stopped)
    cases = [{"name": n, "role": "measured", "ga": 1, "dtype": "fp32"} for n in ("a", "b", "c")]
    recs = runner.world_records(bf16_leak.PROBE, cases, {}, "installed", {"bug": "T"}, 2, "cpu", 60)
    assert [r["case"] for r in recs] == ["a", "b", "c"]
    assert all(r["verdict"] == oracle.CANNOT_RUN for r in recs)
    assert "world stopped after case 1 of 3" in recs[1]["reason"] and "WorldDesynchronised" in recs[2]["reason"]


def test_a_users_stop_ends_the_probe_run_and_launches_no_further_world(monkeypatch):
    """A world stopped by the user is not a failed world whose cases become cannot-run records while the run goes
    on to its next world: the stop reaches the caller (the explorer), and nothing else is launched."""
    from gradkit.probes import runner
    from gradkit.probes import bf16_leak

    calls = []

    def stopped(*a, **k):
        calls.append(1)
        raise launch.WorldStopped("stopped while its ranks started: they were killed as they came up; nothing ran")

    monkeypatch.setattr(launch, "run_world", stopped)
    cases = [{"name": n, "role": "measured", "ga": 1, "dtype": "fp32"} for n in ("a", "b")]
    with pytest.raises(launch.WorldStopped):
        runner.world_records(bf16_leak.PROBE, cases, {}, "installed", {"bug": "T"}, 2, "cpu", 60)
    with pytest.raises(launch.WorldStopped):  # two world sizes: the second is never launched
        runner.run(bf16_leak.PROBE, cases, world_sizes=(2, 3))
    assert calls == [1, 1]


def test_a_rank_that_crashes_in_tear_down_after_its_result_keeps_the_result(capfd):
    out = launch.run_world("gradkit.launch.selftest:abort_after_result", {"rank": 0}, world_size=2, init="torch", timeout_s=60)
    assert [r["rank"] for r in out] == [0, 1]
    assert "rank 0 wrote its result, then killed by signal 6 (SIGABRT)" in capfd.readouterr().err


def test_a_rank_that_aborts_before_its_result_is_a_failure():
    with pytest.raises(launch.RankFailed, match="SIGABRT"):
        launch.run_world("gradkit.launch.selftest:abort_after_result", {"rank": 0, "before": True}, world_size=2, init="torch",
                         timeout_s=60)


def test_a_world_folder_that_never_got_its_owner_is_removed_once_it_is_old(monkeypatch, tmp_path):
    """A caller killed between making its world's folder and writing the owner file left the folder behind; the
    next launch removes it, but not the folder of a world starting right now, nor an old one with a live owner."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # remove_stale_worlds looks in tempfile.gettempdir()
    old = tmp_path / "gradkit-world-killed-at-birth"
    fresh = tmp_path / "gradkit-world-starting-now"
    owned = launch.cleanup.new_world_folder()  # claimed by this (live) process
    for folder in (old, fresh):
        folder.mkdir()
    (old / "owner.tmp").write_text("")  # killed mid-claim: the owner never renamed into place
    long_ago = time.time() - 2 * launch.cleanup.OWNERLESS_GRACE_S
    for folder in (old, owned):
        os.utime(folder, (long_ago, long_ago))
    assert owned.parent == tmp_path and (owned / launch.OWNER_FILE).read_text().split()[0] == str(os.getpid())
    assert launch.remove_stale_worlds() == [old]
    assert not old.exists() and fresh.exists() and owned.exists()


def test_a_world_stopped_on_purpose_is_never_launched_again_as_a_failed_rendezvous(monkeypatch):
    """An interrupt kills the ranks while they start; the rank that notices first reads "Connection reset by peer",
    which looks like a rendezvous failure. The world must not be launched again after the stop (the explorer's
    Interrupt then Stop in a busy JupyterLab saw a relaunched world)."""
    from gradkit.launch import lifecycle

    calls = []

    def once(*a, **k):
        calls.append(1)
        launch.stop_worlds()  # the user's interrupt, while the ranks start
        raise launch.RankFailed("rank 1 raised: Connection reset by peer", rank=1)

    monkeypatch.setattr(lifecycle, "_run_world_once", once)
    with pytest.raises(launch.WorldStopped):  # said as the stop it was, never as a failed world
        launch.run_world("gradkit.launch.selftest:ping", {}, launch.World(world_size=2), keep_dir=None)
    assert calls == [1]

    def flaky(*a, **k):  # without a stop, the same error is a rendezvous failure and is launched again
        calls.append(2)
        if len(calls) < 3:
            raise launch.RankFailed("rank 1 raised: Connection reset by peer", rank=1)
        return ["ok", "ok"]

    monkeypatch.setattr(lifecycle, "_run_world_once", flaky)
    assert launch.run_world("gradkit.launch.selftest:ping", {}, launch.World(world_size=2)) == ["ok", "ok"] and calls == [1, 2, 2]


@pytest.mark.parametrize("warm", [False, True], ids=["one-shot", "warm"])
def test_a_stop_while_the_ranks_start_kills_them_as_they_come_up(monkeypatch, warm):
    """The explorer's Stop or Interrupt while a world starts (a warm world's fork server imports the stack for
    seconds): the world counts as stopped, its ranks are killed as soon as they are up, and the call raises
    WorldStopped. Before, the stop found no ranks to kill ("0 world(s) stopped") and the world ran to its end,
    then stayed up as a warm world, so the browser test's next Run reused it and never saw new ranks."""
    import contextlib

    from gradkit.launch import lifecycle, warm as kwarm

    real, counted = lifecycle.start_ranks, []

    def start_then_stop(*a, **k):
        out = real(*a, **k)  # the ranks are processes now; the caller has not registered them yet
        counted.append(launch.stop_worlds())
        return out

    monkeypatch.setattr(kwarm if warm else lifecycle, "start_ranks", start_then_stop)
    with launch.warm_worlds(keep=False) if warm else contextlib.nullcontext():
        with pytest.raises(launch.WorldStopped, match="while its ranks started"):
            launch.run_world("gradkit.launch.selftest:ping", {}, launch.World(world_size=2, timeout_s=60))
    assert counted == [1]  # the world being started is one of the worlds stopped
    assert not launch.ranks_below(os.getpid())  # killed, not left running (nor kept warm)
    assert not kwarm._WARM
    monkeypatch.undo()
    with launch.warm_worlds(keep=False) if warm else contextlib.nullcontext():  # the next call runs as usual
        assert [r["rank_sum"] for r in launch.run_world("gradkit.launch.selftest:ping", {}, launch.World(world_size=2))] == [1.0, 1.0]


def test_a_stop_while_a_world_is_launched_again_after_a_failed_rendezvous_stops_that_world(monkeypatch):
    """The browser test's flaky failure, as its failure message told it: the first world of a Run failed its
    rendezvous on a busy machine and died (the ranks the test had seen), the Interrupt came while the world
    launched again was starting, and that second world ran to its end and stayed up. A stop at any point of
    a call, retries included, stops the world the call is starting."""
    from gradkit.launch import lifecycle

    real, calls = lifecycle.start_ranks, []

    def start(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise launch.RankFailed("rank 1 raised: Connection reset by peer", rank=1)  # launched again
        out = real(*a, **k)
        launch.stop_worlds()  # the Interrupt, while the second world's ranks start
        return out

    monkeypatch.setattr(lifecycle, "start_ranks", start)
    with pytest.raises(launch.WorldStopped):
        launch.run_world("gradkit.launch.selftest:ping", {}, launch.World(world_size=2, timeout_s=60))
    assert len(calls) == 2 and not launch.ranks_below(os.getpid())
