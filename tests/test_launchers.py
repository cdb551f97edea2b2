"""The kit's launcher driving torchrun and the DeepSpeed launcher: command lines for several nodes, real single-node runs."""
import sys
import time
from pathlib import Path

import pytest

from gradkit import config, launch

JOB = Path("/shared/job")


def _hostfile(tmp_path, text="node-a slots=8\nnode-b slots=8  # second node\n"):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_local_launcher_starts_one_worker_per_rank():
    cmds = launch.launch_commands(launch.World(world_size=2, launcher="local"), JOB, 29500)
    assert cmds == [[sys.executable, "-m", "gradkit.launch.worker", str(JOB)]] * 2


def test_torchrun_on_two_nodes_runs_node_0_here_and_node_1_over_ssh(tmp_path):
    world = launch.World(world_size=16, device="cpu", launcher="torchrun", nnodes=2, hostfile=_hostfile(tmp_path),
                         master_addr="node-a")
    world.validate()
    here, there = launch.launch_commands(world, JOB, 29500)
    torchrun = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "8"]
    assert here == [sys.executable, *torchrun, "--node_rank", "0", "--master_addr", "node-a", "--master_port", "29500",
                    "-m", "gradkit.launch.worker", str(JOB)]
    assert there[:2] == ["ssh", "node-b"]
    assert there[2].startswith(f"cd {JOB} && ")
    assert " ".join(torchrun) + " --node_rank 1 --master_addr node-a --master_port 29500 -m gradkit.launch.worker /shared/job" in there[2]


def test_deepspeed_launcher_gets_the_hostfile_and_the_worker_module(tmp_path):
    hf = _hostfile(tmp_path)
    world = launch.World(world_size=16, launcher="deepspeed", nnodes=2, hostfile=hf, master_addr="node-a")
    world.validate()
    (cmd,) = launch.launch_commands(world, JOB, 29501)
    assert cmd == [sys.executable, "-m", "deepspeed.launcher.runner", "--master_addr", "node-a", "--master_port", "29501",
                   "--hostfile", hf, "--num_nodes", "2", "--num_gpus", "8", "--no_local_rank", "--module", "gradkit.launch.worker",
                   str(JOB)]


def test_launcher_settings_come_from_the_environment(monkeypatch, tmp_path):
    hf = _hostfile(tmp_path)
    for k, v in {"GRADKIT_LAUNCHER": "deepspeed", "GRADKIT_NNODES": "2", "GRADKIT_HOSTFILE": hf,
                 "GRADKIT_MASTER_ADDR": "node-a"}.items():
        monkeypatch.setenv(k, v)
    world = launch.World(world_size=4)
    assert (world.launcher, world.nnodes, world.hostfile, world.master_addr, world.nproc_per_node) == \
        ("deepspeed", 2, hf, "node-a", 2)


@pytest.mark.parametrize("kw, hosts, match", [
    ({"nnodes": 2, "launcher": "local"}, "a slots=2\nb slots=2\n", "several nodes need launcher"),
    ({"nnodes": 2, "launcher": "torchrun"}, None, "need a hostfile"),
    ({"nnodes": 3, "launcher": "torchrun", "world_size": 6}, "a slots=2\nb slots=2\n", "hostfile .* names 2"),
    ({"nnodes": 2, "launcher": "deepspeed", "world_size": 8}, "a slots=2\nb slots=2\n", "only 2 slots"),
    ({"nnodes": 2, "launcher": "deepspeed", "world_size": 3}, "a slots=2\nb slots=2\n", "does not split evenly"),
    ({"nnodes": 2, "launcher": "deepspeed"}, "a slots=two\n", "expected 'HOST slots=N'"),
    ({"launcher": "mpirun"}, None, "launcher must be one of"),
])
def test_impossible_launches_are_refused_before_anything_starts(tmp_path, kw, hosts, match):
    kw = {"world_size": 4, **kw}
    if hosts is not None:
        kw["hostfile"] = _hostfile(tmp_path, hosts)
    with pytest.raises(config.ConfigError, match=match):
        launch.World(**kw).validate()


@pytest.mark.world
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_real_world_through_each_launcher(launcher):
    out = launch.run_world("gradkit.launch.selftest:ping", {"echo": 3}, launch.World(world_size=2, launcher=launcher, init="torch",
                                                                          timeout_s=120))
    assert [r["rank"] for r in out] == [0, 1] and all(r["rank_sum"] == 1.0 and r["echo"] == 3 for r in out)


@pytest.mark.world
def test_a_raising_rank_under_torchrun_is_named():
    t0 = time.time()
    with pytest.raises(launch.RankFailed) as e:
        launch.run_world("gradkit.launch.selftest:fail_on_rank", {"rank": 1, "message": "needle-7"},
                         launch.World(world_size=2, launcher="torchrun", init="torch", timeout_s=60))
    assert e.value.rank == 1 and "needle-7" in str(e.value)
    assert time.time() - t0 < 60


def test_a_half_written_error_file_does_not_hide_the_rank_that_raised(tmp_path):
    # CI stop 20: torchrun killed rank 0 while it wrote its error file, and the caller crashed on the empty file
    import json
    (tmp_path / "rank0.error.json").write_text("")
    (tmp_path / "rank1.error.json").write_text(json.dumps({"rank": 1, "time": 1.0, "type": "RuntimeError",
                                                           "message": "needle-8", "traceback": "tb"}))
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    from gradkit.launch import results
    e = results.blame([0, 1], [1, 1], tmp_path, logs, by_exit=False)
    assert e.rank == 1 and "needle-8" in str(e)


def test_a_rank_that_stopped_because_a_peer_did_is_not_blamed_even_when_seen_first(tmp_path):
    """CI of session 43: rank 1 was SIGKILLed, rank 0 then raised WorldDesynchronised at the barrier after the case
    and its exit was seen first. The killed rank is the cause."""
    import json
    (tmp_path / "rank0.error.json").write_text(json.dumps({
        "rank": 0, "time": 1.0, "type": "WorldDesynchronised", "traceback": "tb",
        "message": "case 'x' (GA=4) ended on rank 0 (ok) but not on every rank within 120 s: Connection closed"}))
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    from gradkit.launch import results
    e = results.blame([0, 1], [1, -9], tmp_path, logs)
    assert e.rank == 1 and str(e).startswith("rank 1 died: killed by signal 9 (SIGKILL)")
    assert "Then: rank 0 exited with code 1 after WorldDesynchronised" in str(e)
    e = results.blame([0], [1, None], tmp_path, logs)  # alone, it is all there is to say
    assert e.rank == 0 and "WorldDesynchronised" in str(e)


def test_dry_run_prints_the_command_lines(tmp_path, capsys):
    hf = _hostfile(tmp_path)
    assert launch.main(["--world-size", "16", "--device", "cuda", "--launcher", "deepspeed", "--nnodes", "2",
                        "--hostfile", hf, "--master-addr", "node-a", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"--hostfile {hf} --num_nodes 2 --num_gpus 8 --no_local_rank --module gradkit.launch.worker" in out


def test_world_size_limit_counts_the_nodes(monkeypatch):
    cores_limit = config.max_world_size("cpu")
    with pytest.raises(config.ConfigError, match="more than this machine"):
        config.check_world_size(cores_limit + 1, "cpu")
    monkeypatch.setenv("GRADKIT_LAUNCHER", "torchrun")
    monkeypatch.setenv("GRADKIT_NNODES", "2")
    config.check_world_size(cores_limit + 1, "cpu")  # two nodes hold it
    monkeypatch.setenv("GRADKIT_NNODES", "zero")
    with pytest.raises(config.ConfigError, match="GRADKIT_NNODES"):
        config.check_world_size(2, "cpu")


def test_runall_refuses_cuda_without_a_gpu(repo, tmp_path):
    import torch

    from gradkit.notebooks import runall
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(config.ConfigError, match="no CUDA device"):
        runall.main([str(repo / "notebooks" / "05_explorer.ipynb"), "--device", "cuda", "--out", str(tmp_path)])
