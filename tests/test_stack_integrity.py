"""A record is of the release it names, or it is cannot-run: damaged overlays and comm-op builds are caught."""
import os
import shutil

import pytest

from gradkit import launch
from gradkit.judge import oracle
from gradkit.stacks import versions
from gradkit.probes import bf16_leak

pytestmark = pytest.mark.world
OLD = "0.18.9"


@pytest.fixture(scope="module")
def shared_cache():
    """The suite's cache, with the 0.18.9 overlay installed and the installed release's comm op built (once)."""
    versions.ensure_overlay("deepspeed", OLD)
    launch.run_world("gradkit.launch.selftest:ping", {}, launch.World(world_size=1, init="deepspeed", timeout_s=300))
    return versions.overlay_root().parent


@pytest.fixture
def private_cache(shared_cache, tmp_path, monkeypatch):
    """A cache of its own (so damage never touches the suite's), seeded with copies from the shared one."""
    monkeypatch.setenv("GRADKIT_CACHE", str(tmp_path))
    return shared_cache, tmp_path


def test_a_damaged_overlay_is_cannot_run_never_the_installed_release(private_cache):
    """deepspeed/__init__.py of the 0.18.9 overlay gone: Python would fall through to the installed 0.19.8."""
    shared, cache = private_cache
    src = shared / "overlays" / f"deepspeed-{OLD}"
    dst = cache / "overlays" / f"deepspeed-{OLD}"
    shutil.copytree(src, dst)
    shutil.copytree(shared / "torch_extensions", cache / "torch_extensions")
    (dst / "deepspeed" / "__init__.py").unlink()
    # what the ranks would import if the overlay were trusted as it is: the world refuses to run
    stack = versions.Stack(versions={"deepspeed": OLD}, pythonpath=[str(dst)], roots={"deepspeed": str(dst)})
    with pytest.raises(launch.RankFailed, match=r"StackMismatch.*0\.18\.9 was requested, 0\.19\.8 was imported"):
        launch.run_world("gradkit.launch.selftest:ping", {},
                         launch.World(world_size=2, init="torch", expect=stack.expect, pythonpath=stack.pythonpath,
                                      timeout_s=120))
    # and the manifest written at install names the damage
    assert "missing: deepspeed/__init__.py" in versions.overlay_damage(dst)


def test_records_of_a_mismatched_stack_are_cannot_run(private_cache, monkeypatch):
    shared, cache = private_cache
    shutil.copytree(shared / "torch_extensions", cache / "torch_extensions")
    wrong = versions.resolve_stack({})
    wrong.versions["deepspeed"] = OLD  # the label says 0.18.9; the ranks import the installed release
    monkeypatch.setattr(versions, "resolve_stack", lambda wanted=None, packages=None: wrong)
    recs = bf16_leak.run(world_size=2, ga_values=(2,), versions=(OLD,), cases=("leak", "control"), timeout_s=120)
    assert {r["verdict"] for r in recs} == {oracle.CANNOT_RUN}
    assert all(f"{OLD} was requested" in r["reason"] for r in recs), recs[0]["reason"]


def test_a_damaged_overlay_is_reinstalled(private_cache):
    _, cache = private_cache
    root = versions.ensure_overlay("huggingface-hub", "1.33.0")  # small, pure Python
    victim = root / "huggingface_hub" / "__init__.py"
    victim.write_text(victim.read_text()[:100])  # truncated
    assert versions.overlay_damage(root) == ["changed: huggingface_hub/__init__.py"]
    again = versions.ensure_overlay("huggingface-hub", "1.33.0")
    assert again == root and versions.overlay_damage(root) == []
    assert len(victim.read_text()) > 100


def test_a_truncated_comm_op_is_rebuilt_not_a_sigbus(private_cache):
    shared, cache = private_cache
    ext = cache / "torch_extensions"
    shutil.copytree(shared / "torch_extensions", ext)
    key = launch.installed_key()
    so = next((ext / key).rglob("*.so"))
    size = so.stat().st_size
    with open(so, "r+b") as f:
        f.truncate(size // 3)
    assert "truncated" in launch.elf_damage(so)
    out = launch.run_world("gradkit.launch.selftest:ping", {},
                           launch.World(world_size=2, init="deepspeed", timeout_s=300))
    assert [r["rank_sum"] for r in out] == [1.0, 1.0]
    assert launch.elf_damage(so) is None and os.path.getsize(so) > size // 3


def test_a_build_lock_left_by_a_killed_rank_does_not_hang_the_next_world(private_cache):
    """torch's JIT build lock (``<build dir>/lock``), left by a rank killed while it loaded the comm op: every later
    rank of that release used to wait for it forever. The ranks lock with ``flock`` now and remove it."""
    shared, cache = private_cache
    ext = cache / "torch_extensions"
    shutil.copytree(shared / "torch_extensions", ext)
    (lock,) = [so.parent / "lock" for so in (ext / launch.installed_key()).rglob("*.so")]
    lock.touch()  # what a SIGKILL during init_distributed leaves
    out = launch.run_world("gradkit.launch.selftest:ping", {},
                           launch.World(world_size=2, init="deepspeed", timeout_s=60))
    assert [r["rank_sum"] for r in out] == [1.0, 1.0] and not lock.exists()



HOLD = ("import os, sys\n"  # torch's FileBaton: the lock made with O_EXCL, held open, closed and removed at release
        "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
        "os.close(fd)\n"
        "os.remove(sys.argv[1])\n")


def _hold(lock):
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_build_under_torchs_own_lock_is_waited_for_never_taken_over(tmp_path):
    """The sweep's reproduction script is plain DeepSpeed: its ranks build the comm op under torch's own baton in
    the kit's build folder. A kit rank took the flock, removed that live lock as a dead builder's, and the script's
    rank then failed in its own release() (FileNotFoundError): exit 1 before anything was judged."""
    import threading

    from gradkit.launch.worker import FlockBaton, lock_holder

    lock = tmp_path / "lock"
    holder = _hold(lock)
    assert lock_holder(lock) == holder.pid
    assert FlockBaton(str(lock)).try_acquire() is False and lock.exists()  # not taken over
    waiting = threading.Thread(target=FlockBaton(str(lock)).wait)
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive()  # it waits for that build
    holder.communicate("")  # the build is done: the holder releases its own baton
    assert holder.returncode == 0  # and its release() found its lock
    waiting.join(30)  # a hang guard: it returns within a poll
    assert not waiting.is_alive()
    lock.touch()  # a lock whose holder died: nobody holds it open, so it is taken over
    assert lock_holder(lock) is None
    baton = FlockBaton(str(lock))
    assert baton.try_acquire() and not lock.exists()
    baton.release()


def test_a_world_waits_for_a_build_under_torchs_own_lock_and_the_holder_ends_well(private_cache, tmp_path):
    """The same in a real world: its ranks say they wait for the holder's build, leave its lock alone, and run
    once it is released; the holder's release succeeds."""
    import threading
    import time

    shared, cache = private_cache
    ext = cache / "torch_extensions"
    shutil.copytree(shared / "torch_extensions" / launch.installed_key(), ext / launch.installed_key())
    (lock,) = [so.parent / "lock" for so in (ext / launch.installed_key()).rglob("*.so")]
    holder = _hold(lock)
    job, out = tmp_path / "world", {}
    world = threading.Thread(target=lambda: out.update(r=launch.run_world(
        "gradkit.launch.selftest:ping", {}, launch.World(world_size=2, init="deepspeed", timeout_s=300), keep_dir=str(job))))
    world.start()
    deadline = time.monotonic() + 240  # a hang guard: the ranks reach the build lock within seconds
    said = lambda: "".join(p.read_text(errors="replace") for p in job.glob("rank*.log"))  # noqa: E731
    while "waiting for process" not in said() and world.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"waiting for process {holder.pid}'s build" in said(), said()
    assert lock.exists() and world.is_alive()  # its lock left alone, the world waiting
    holder.communicate("")
    world.join(240)
    assert holder.returncode == 0 and [r["rank_sum"] for r in out["r"]] == [1.0, 1.0]

def test_two_environments_sharing_the_cache_build_their_comm_op_in_folders_of_their_own(monkeypatch):
    """Two clones or venvs with one GRADKIT_CACHE: torch's build file names the environment's paths, so a folder
    shared between them was rebuilt at every switch (about a minute, every rank of that release waiting)."""
    import sys

    key = lambda release="0.19.8": versions.Stack({"deepspeed": release}).extensions_key  # noqa: E731
    here = key()
    assert here.startswith("deepspeed-0.19.8-") and here == key()  # one environment: one folder per release
    assert key("0.18.9").startswith("deepspeed-0.18.9-") and key("0.18.9") != here
    with monkeypatch.context() as m:
        m.setattr(sys, "prefix", sys.prefix + "-another-venv")
        assert key() != here  # another environment: its own folder
    real = versions.installed_version
    with monkeypatch.context() as m:
        m.setattr(versions, "installed_version", lambda p: "2.99.0" if p == "torch" else real(p))
        assert key() != here  # the same environment with another torch: rebuilt in a folder of its own
    assert key() == here
    # a patched release's sources sit in its own overlay, and torch's build arguments name them: a folder of its own
    assert len({key("0.19.8+b9"), key("0.19.8+b9.b10"), here}) == 3
