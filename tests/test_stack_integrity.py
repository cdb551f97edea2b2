"""A record is of the release it names, or it is cannot-run: damaged overlays and comm-op builds are caught."""
import os
import shutil

import pytest

from kit import launch, oracle, versions
from kit.probes import bf16_leak

pytestmark = pytest.mark.world
OLD = "0.18.9"


@pytest.fixture(scope="module")
def shared_cache():
    """The suite's cache, with the 0.18.9 overlay installed and the installed release's comm op built (once)."""
    versions.ensure_overlay("deepspeed", OLD)
    launch.run_world("kit.selftest:ping", {}, launch.World(world_size=1, init="deepspeed", timeout_s=300))
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
        launch.run_world("kit.selftest:ping", {}, launch.World(world_size=2, init="torch", expect=stack.expect,
                                                               pythonpath=stack.pythonpath, timeout_s=120))
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
    key = launch._installed_key()
    so = next((ext / key).rglob("*.so"))
    size = so.stat().st_size
    with open(so, "r+b") as f:
        f.truncate(size // 3)
    assert "truncated" in launch.elf_damage(so)
    out = launch.run_world("kit.selftest:ping", {}, launch.World(world_size=2, init="deepspeed", timeout_s=300))
    assert [r["rank_sum"] for r in out] == [1.0, 1.0]
    assert launch.elf_damage(so) is None and os.path.getsize(so) > size // 3


def test_a_build_lock_left_by_a_killed_rank_does_not_hang_the_next_world(private_cache):
    """torch's JIT build lock (``<build dir>/lock``), left by a rank killed while it loaded the comm op: every later
    rank of that release used to wait for it forever. The ranks lock with ``flock`` now and remove it."""
    shared, cache = private_cache
    ext = cache / "torch_extensions"
    shutil.copytree(shared / "torch_extensions", ext)
    (lock,) = [so.parent / "lock" for so in (ext / launch._installed_key()).rglob("*.so")]
    lock.touch()  # what a SIGKILL during init_distributed leaves
    out = launch.run_world("kit.selftest:ping", {}, launch.World(world_size=2, init="deepspeed", timeout_s=60))
    assert [r["rank_sum"] for r in out] == [1.0, 1.0] and not lock.exists()


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
