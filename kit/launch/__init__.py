"""Run one importable function on W ranks and get each rank's JSON result back.

Modelled on DeepSpeed's ``tests/unit/common.py`` ``DistributedTest``: one call
starts a world, waits with a timeout, and either returns every rank's result or
raises an error that names the rank and carries its traceback.

The world is a set of fresh ``python -m kit.launch.worker`` processes, never a fork of
the caller, so it works from a notebook kernel (nothing from ``__main__`` is
pickled) and under a DeepSpeed/transformers version overlay (``kit.stacks.versions``)
that the caller itself does not import.

    results = run_world("kit.launch.selftest:ping", {"x": 1}, world_size=2)

Each rank runs ``fn(payload)``; the function returns something
JSON-serialisable. Ranks find each other on 127.0.0.1 (gloo on CPU, nccl on
CUDA). The CPU comm op DeepSpeed JIT-builds in ``init_distributed`` is kept in
``<cache>/torch_extensions/<deepspeed version>`` so only the first launch of a
version pays for the build.

Where things are (everything other code uses is re-exported here, as ``kit.launch.NAME``):

- ``spec``: the world spec and commands: ``World``, the errors (``LaunchError``, ``RankFailed``,
  ``RankTimeout``, ``WorldStopped``), ``REPO_ROOT``, ``LAUNCHERS``, the hostfile, each rank's / launcher's command line and
  environment, the torch-extensions cache check (``elf_damage``, ``repair_extensions``), and ``main``
  (``python -m kit.launch --dry-run``).
- ``lifecycle``: the life of a world's processes: ``run_world`` (with its rendezvous retry), starting the ranks,
  waiting for them, killing them (``die_with_parent``, ``kill_tree``, ``stop_worlds``, ``check_stop``, ``ranks_below``), and
  the world folders of callers that were killed (``OWNER_FILE``, ``remove_stale_worlds``).
- ``warm``: warm worlds, ranks kept up between calls: ``warm_worlds``, ``prewarm``, ``stop_warm_worlds``.
- ``servers``: fork servers, which fork a stack's warm ranks with its imports paid (``NO_FORK_ENV``).
- ``results``: reading what the ranks left: result and error records, partial reports, the rank to blame.

A limit or timeout is read in the submodule that defines it: set it there (``launch.warm.WARM_IDLE_S``,
``launch.servers.SERVER_IDLE_S``, ``launch.lifecycle.OWNERLESS_GRACE_S`` ...), not on this package. Callers
outside the package call ``launch.run_world(...)`` through this package, so replacing ``launch.run_world``
here reaches them.
"""
from kit.launch.lifecycle import (OWNER_FILE, PR_SET_PDEATHSIG, _session_dying_with_parent, check_stop, die_with_parent,
                                  kill_tree, ranks_below, remove_stale_worlds, run_world, stop_worlds)
from kit.launch.results import _failure, _PartialReader, how_it_ended
from kit.launch.servers import _SERVERS, NO_FORK_ENV
from kit.launch.spec import (LAUNCHERS, REPO_ROOT, LaunchError, RankFailed, RankTimeout, World, WorldStopped,
                             _installed_key, elf_damage, launch_commands, launcher_env, main, rank_env, read_hostfile,
                             repair_extensions, worker_module_args)
from kit.launch.warm import _WARM, WARM_MAX, prewarm, stop_warm_worlds, warm_worlds
