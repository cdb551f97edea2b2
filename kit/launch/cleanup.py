"""What a world leaves on the machine, and its removal: the world's folder (claimed for its caller at once:
``OWNER_FILE``), removed by ``remove_stale_worlds`` once that caller is gone, and the shared-memory segments
DeepSpeed's CPU comm op makes per rank, removed with the port that names them (``release_port``) or as orphans."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

OWNER_FILE = "owner"  # "<pid> <process start time>" of the process that started a world and owns its folder
# A world folder with no owner file is left alone this long after it last changed: it may be a world starting now.
OWNERLESS_GRACE_S = 60.0


def new_world_folder(keep_dir: str | None = None, prefix: str = "gradkit-world-") -> Path:
    """The folder of a world starting now (``keep_dir``, or a fresh ``$TMPDIR/<prefix>*``; a job server's:
    ``gradkit-jobs-``), claimed for this process at once: its ``OWNER_FILE`` is written right after the folder is
    made, before anything slow (a fork server's start, the ranks'), and whole (renamed into place), so that
    ``remove_stale_worlds`` can tell a world whose caller is gone from one still starting."""
    import psutil

    job = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix=prefix))
    try:
        job.mkdir(parents=True, exist_ok=True)
        tmp = job / (OWNER_FILE + ".tmp")
        tmp.write_text(f"{os.getpid()} {psutil.Process().create_time()}")
        os.replace(tmp, job / OWNER_FILE)
    except BaseException:
        if keep_dir is None:
            shutil.rmtree(job, ignore_errors=True)
        raise
    return job


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"  # DeepSpeed's CPU comm op: one 66 MB segment per rank, never unlinked
ORPHAN_SHM_GRACE_S = 60.0


def _unlink(paths) -> list[Path]:
    """Remove ``paths``; the ones that were removed (another process may have taken one first)."""
    removed = []
    for path in paths:
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def release_port(holder) -> list[Path]:
    """The world that held ``holder``'s port is over: free the port and remove the shared-memory segments DeepSpeed's
    CPU comm op made for it. ``shm.cpp`` names them ``deepspeed_allreduce_buffer_<uid>_<addr>_<MASTER_PORT>_<rank>``
    (66 MB each, in RAM) and never unlinks them, so every DeepSpeed world on CPU left W of them behind: a few
    hundred worlds (a sweep, the test suite) filled /dev/shm and the machine's memory."""
    try:
        port = holder.getsockname()[1]
    except OSError:  # closed already (a launcher's world listened on it itself): remove_orphan_segments takes them
        return []
    try:  # the segments go while the port is still held: a world that gets the number next makes its own after
        segments = SHM_DIR.glob(f"{SHM_PREFIX}_{os.getuid()}_*_{port}_*")
        return _unlink(p for p in segments if p.name.rsplit("_", 1)[-1].isdigit())  # ..._<port>_<rank>
    finally:
        holder.close()


def remove_orphan_segments(grace_s: float = ORPHAN_SHM_GRACE_S) -> list[Path]:
    """Remove this user's DeepSpeed CPU comm segments that no live process maps and that are older than
    ``grace_s`` (a world killed before the kit could remove them): a segment only its own world's ranks ever open,
    and they are gone. A segment a running DeepSpeed job maps (the kit's or the user's own) is never touched."""
    now = time.time()
    mine = []
    for p in SHM_DIR.glob(f"{SHM_PREFIX}_{os.getuid()}_*"):
        try:
            if now - p.stat().st_mtime > grace_s:
                mine.append(p)
        except OSError:
            pass
    if not mine:  # the common case (every world removes its own): no need to read every process's maps
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        if SHM_PREFIX in text:
            mapped.update(line.rsplit("/", 1)[-1].split(" ")[0] for line in text.splitlines() if SHM_PREFIX in line)
    return _unlink(p for p in mine if p.name not in mapped)


def remove_stale_worlds() -> list[Path]:
    """Remove the world and job-server folders whose owner is gone (a caller killed with SIGKILL never ran its
    clean-up, nor did a job server killed so), and those that never got an owner (a caller killed between making the
    folder and claiming it); and the shared-memory segments of DeepSpeed worlds that are gone
    (``remove_orphan_segments``)."""
    import psutil

    remove_orphan_segments()
    removed = []
    tmp = Path(tempfile.gettempdir())
    for folder in [*tmp.glob("gradkit-world-*"), *tmp.glob("gradkit-jobs-*")]:
        try:
            pid, started = (folder / OWNER_FILE).read_text().split()
            alive = psutil.pid_exists(int(pid)) and abs(psutil.Process(int(pid)).create_time() - float(started)) < 1
        except FileNotFoundError:
            # No owner. ``new_world_folder`` writes it microseconds after making the folder (and making a file in
            # the folder, the owner's temporary one included, makes the folder's mtime new): an ownerless folder
            # that has not changed for OWNERLESS_GRACE_S is one whose caller died in between, never a world that
            # is starting now. (Writing the owner atomically *with* the folder would need the folder made under
            # another name and renamed into place, which leaves the same window at that other name.)
            try:
                alive = time.time() - folder.stat().st_mtime < OWNERLESS_GRACE_S
            except OSError:
                continue  # removed meanwhile
        except (OSError, ValueError, psutil.Error):
            continue  # not the kit's, or not this user's
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
