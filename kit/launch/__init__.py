"""Run one importable function on W ranks and get each rank's JSON result back.

Modelled on DeepSpeed's ``tests/unit/common.py`` ``DistributedTest``: one call
starts a world, waits with a timeout, and either returns every rank's result or
raises an error that names the rank and carries its traceback.

The world is a set of fresh ``python -m gradkit.launch.worker`` processes, never a fork of
the caller, so it works from a notebook kernel (nothing from ``__main__`` is
pickled) and under a DeepSpeed/transformers version overlay (``gradkit.stacks.versions``)
that the caller itself does not import.

    results = run_world("gradkit.launch.selftest:ping", {"x": 1}, world_size=2)

Each rank runs ``fn(payload)``; the function returns something
JSON-serialisable. Ranks find each other on 127.0.0.1 (gloo on CPU, nccl on
CUDA). The CPU comm op DeepSpeed JIT-builds in ``init_distributed`` is kept in
``<cache>/torch_extensions/<deepspeed version>`` so only the first launch of a
version pays for the build.

Where things are (everything other code uses is re-exported here, as ``gradkit.launch.NAME``), each module built only on
those listed before it:

- ``spec``: the world spec and commands: ``World``, the errors (``LaunchError``, ``RankFailed``,
  ``RankTimeout``, ``WorldStopped``), ``REPO_ROOT``, ``LAUNCHERS``, the hostfile, each rank's / launcher's command line and
  environment, the torch-extensions cache check (``elf_damage``, ``repair_extensions``, ``installed_key``), and ``main``
  (``python -m gradkit.launch --dry-run``).
- ``results``: reading what the ranks left: result and error records, partial reports (``PartialReader``), the rank
  to blame.
- ``processes``: the kit's processes: dying with the caller (``die_with_parent``, ``session_dying_with_parent``),
  killing them (``kill_tree``), the user's stop (``stop_worlds``, ``check_stop``), finding ranks (``ranks_below``).
- ``cleanup``: what worlds leave behind: world folders (``OWNER_FILE``, ``remove_stale_worlds``) and DeepSpeed's
  shared-memory segments (``remove_orphan_segments``).
- ``servers``: fork servers, which fork a stack's warm ranks with its imports paid (``NO_FORK_ENV``).
- ``ranks``: starting a world's ranks (started, or forked by a fork server) and waiting for them.
- ``warm``: warm worlds, ranks kept up between calls: ``warm_worlds``, ``prewarm``, ``stop_warm_worlds``.
- ``lifecycle``: ``run_world``: a job of a warm world or a one-shot world, with its rendezvous retry.
- ``jobs``: job servers, which fork a user script's torchrun agent and ranks with the stack's imports paid; used by
  ``scripts`` (a user's own script under torchrun or accelerate launch: reproductions, the watch's jobs, recipes).

``worker`` (every rank's process), ``forkserver`` (a fork server's process), ``jobserver`` and ``jobclient`` (a job
server's process, and what torchrun starts as each rank) and ``selftest`` (rank functions that check the launcher) are
run in other processes, never imported here.

A limit or timeout is read in the submodule that defines it: set it there (``launch.warm.WARM_IDLE_S``,
``launch.servers.SERVER_IDLE_S``, ``launch.cleanup.OWNERLESS_GRACE_S`` ...), not on this package. Callers
outside the package call ``launch.run_world(...)`` through this package, so replacing ``launch.run_world``
here reaches them.
"""
from gradkit.launch.cleanup import OWNER_FILE, remove_orphan_segments, remove_stale_worlds
from gradkit.launch.lifecycle import run_world
from gradkit.launch.processes import (PR_SET_PDEATHSIG, check_stop, die_with_parent, kill_tree, ranks_below,
                                  session_dying_with_parent, stop_worlds)
from gradkit.launch.results import PartialReader, how_it_ended
from gradkit.launch.servers import NO_FORK_ENV
from gradkit.launch.spec import (LAUNCHERS, REPO_ROOT, LaunchError, RankFailed, RankTimeout, World, WorldStopped,
                             elf_damage, installed_key, launch_commands, launcher_env, main, rank_env, read_hostfile,
                             repair_extensions, worker_module_args)
from gradkit.launch.warm import WARM_MAX, prewarm, stop_warm_worlds, warm_worlds
