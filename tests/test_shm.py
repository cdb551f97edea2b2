"""DeepSpeed's CPU comm op makes a 66 MB shared-memory segment per rank (``/dev/shm/deepspeed_allreduce_buffer_*``,
named by MASTER_PORT) and never unlinks it: the kit removes a world's segments when the world ends, and orphans
(a world killed before that) when the next world starts, never a segment a live process maps."""
import mmap
import os
import time

import pytest

from gradkit import launch
from gradkit.launch import cleanup, lifecycle


def _segments():
    return sorted(p.name for p in cleanup.SHM_DIR.glob(f"{cleanup.SHM_PREFIX}_{os.getuid()}_*"))


@pytest.mark.world
def test_a_deepspeed_world_leaves_no_shared_memory_behind(monkeypatch):
    """Each world's own segments (found by the port it held, as DeepSpeed names them) exist while it runs and are
    gone after it, one-shot and warm; other tests' worlds may run meanwhile and are not looked at."""
    from gradkit.launch import warm

    seen = []
    real = cleanup.release_port

    def spy(holder):
        port = holder.getsockname()[1]

        def mine():
            return sorted(p.name for p in cleanup.SHM_DIR.glob(f"{cleanup.SHM_PREFIX}_{os.getuid()}_*_{port}_*"))

        made = mine()
        real(holder)
        seen.append((port, made, mine()))

    monkeypatch.setattr(lifecycle, "release_port", spy)
    monkeypatch.setattr(warm, "release_port", spy)
    # DeepSpeed's init_distributed on CPU
    launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, timeout_s=300)
    with launch.warm_worlds(keep=False):  # a warm world's segments go with it too
        launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, timeout_s=300)
    assert len(seen) == 2, seen
    for port, made, left in seen:
        assert len(made) == 2, (port, made)  # DeepSpeed's comm op made one per rank: there was something to remove
        assert left == [], (port, left)


def test_an_orphan_segment_is_removed_and_a_mapped_one_kept():
    orphan = cleanup.SHM_DIR / f"{cleanup.SHM_PREFIX}_{os.getuid()}_127.0.0.1_1_0"
    held = cleanup.SHM_DIR / f"{cleanup.SHM_PREFIX}_{os.getuid()}_127.0.0.1_2_0"
    young = cleanup.SHM_DIR / f"{cleanup.SHM_PREFIX}_{os.getuid()}_127.0.0.1_3_0"
    for p in (orphan, held, young):
        p.write_bytes(b"\0" * 4096)
    old = time.time() - 2 * cleanup.ORPHAN_SHM_GRACE_S
    os.utime(orphan, (old, old))
    os.utime(held, (old, old))
    with open(held, "r+b") as f:
        view = mmap.mmap(f.fileno(), 4096)  # a live process maps it, as a running rank does
        try:
            removed = cleanup.remove_orphan_segments()
            assert orphan in removed and not orphan.exists()
            assert held.exists() and young.exists()  # mapped; too young to judge (a world starting now)
        finally:
            view.close()
            held.unlink()
            young.unlink()


def test_a_worlds_segments_go_while_its_port_is_still_held_and_no_others(monkeypatch):
    """A world that gets the same port number next makes segments of the same names: they must be removed before
    the number is free again, never after (then they could be that next world's)."""
    import socket

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    uid = os.getuid()
    ours = [cleanup.SHM_DIR / f"{cleanup.SHM_PREFIX}_{uid}_127.0.0.1_{port}_{r}" for r in (0, 1)]
    others = [cleanup.SHM_DIR / f"{cleanup.SHM_PREFIX}_{uid}_127.0.0.1_{port + 1}_0",  # another world's
              cleanup.SHM_DIR / f"{cleanup.SHM_PREFIX}_{uid}_127.0.0.1_{port}_x"]  # not a rank's
    held = []
    real = cleanup._unlink
    monkeypatch.setattr(cleanup, "_unlink", lambda paths: held.append(holder.fileno() != -1) or real(paths))
    for p in ours + others:
        p.write_bytes(b"\0")
    try:
        assert sorted(cleanup.release_port(holder)) == ours
        assert held == [True] and holder.fileno() == -1  # removed while held; the port is free afterwards
        assert not any(p.exists() for p in ours) and all(p.exists() for p in others)
    finally:
        for p in ours + others:
            p.unlink(missing_ok=True)
