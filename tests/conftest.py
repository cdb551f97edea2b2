import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import testmap_build  # noqa: E402  (scripts/testmap_build.py: builds the map of which tests reach which code)

# The suite uses the kit's own cache of this machine (``GRADKIT_CACHE``, else ~/.cache/gradkit): its overlays, comm
# ops and extra package sets are keyed by what they are built from (a release, a requirement set, a build environment)
# and verified by their manifests, so every clone and every run on the machine installs and builds each once. A test
# that damages a stack does it in a cache of its own (tmp_path).


@pytest.fixture(scope="session")
def repo() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def warm_module():
    """The module's probe runs share warm worlds, as a notebook's cells do in a kernel (``gradkit.probes.runner.run``):
    a stack's imports and DeepSpeed's first ``initialize`` are paid once per module, not once per run. The worlds
    are still real 2-rank worlds; ``test_warm_worlds`` shows a warm world's records equal a fresh world's."""
    from gradkit import launch

    with launch.warm_worlds(keep=False):  # its worlds go at the module's end; the fork servers stay for the next
        yield


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo world in this process (a HashStore: no port, no file), for the module's tests that run a rank's
    code here (``test_common.py``, ``test_ds_config_here.py``, ``test_watch_sharded_here.py``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def deepspeed_here(one_rank):
    """DeepSpeed's engine in this process, as one rank: the environment a rank gets (its rank variables, the CPU
    accelerator, the installed release's comm-op build folder) over ``one_rank``'s gloo group; afterwards DeepSpeed's
    handle on that group dropped and the CPU accelerator's fp16 answer (``allow_fp16_on_cpu``) put back."""
    from deepspeed.accelerator import get_accelerator

    from gradkit import config as kconfig
    from gradkit.launch import spec

    accelerator = get_accelerator()
    fp16 = accelerator.__dict__.get("is_fp16_supported")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "29500", "DS_ACCELERATOR": "cpu",
                     "TORCH_EXTENSIONS_DIR": str(kconfig.cache_dir() / "torch_extensions" / spec.installed_key())
                     }.items():
            mp.setenv(k, v)
        yield mp
    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups

    ds_comm.cdb = None  # DeepSpeed's handles on one_rank's group (and groups made from it), destroyed next
    for name, value in list(vars(ds_groups).items()):
        if not (name.startswith("_") and name.strip("_").replace("_", "").isupper()) or isinstance(value, str):
            continue
        if isinstance(value, dict):
            value.clear()
        else:
            setattr(ds_groups, name, None)
    if fp16 is None:
        accelerator.__dict__.pop("is_fp16_supported", None)


# The slowest files first (scripts/test.sh runs xdist with --no-loadscope-reorder, which keeps this order; its
# default puts the files with the most tests first): the two workers then finish together, instead of one of
# them running the 2-minute notebook file alone at the end. Measured with `bash scripts/test.sh --durations=0`.
SLOW_FIRST = ("test_notebooks.py", "test_check_corpus.py", "test_watch_trainer_jobs.py", "test_faults.py",
              "test_recipes.py", "test_bisect.py", "test_sweep.py", "test_watch_jobs.py", "test_runall.py",
              "test_browser.py", "test_watch_sharded.py", "test_docs.py", "test_launch.py", "test_jobs.py",
              "test_check.py", "test_warm_worlds.py", "test_check_paths.py")


def pytest_collection_modifyitems(config, items):
    if any("::" in str(a) for a in config.args):  # a list of tests (a mutant's, cheapest first): kept as given
        return
    items.sort(key=lambda item: SLOW_FIRST.index(item.path.name) if item.path.name in SLOW_FIRST else len(SLOW_FIRST))


# While scripts/testmap_build.py builds the map (TESTMAP_BUILD set), coverage's context is the running test during
# its call (and in what the call starts), and its file during set-up and tear-down (a module's fixtures serve the
# whole file).
if os.environ.get(testmap_build.ENV):
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item):
        testmap_build.switch(None, item.nodeid.split("::")[0])
        testmap_build.fork_servers(item.nodeid.split("::")[0])
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        testmap_build.switch(item.nodeid, item.nodeid.split("::")[0])
        yield
        testmap_build.test_done(item.nodeid.split("::")[0])
        testmap_build.switch(None, item.nodeid.split("::")[0])

    def pytest_runtest_logreport(report):  # in the controller too (xdist hands it every worker's reports)
        testmap_build.took(report.nodeid, report.duration)

    def pytest_sessionfinish(session):
        if not hasattr(session.config, "workerinput"):  # the controller, or a run without workers
            testmap_build.write_durations()
