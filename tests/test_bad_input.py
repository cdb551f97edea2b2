"""Bad input never launches: every case exits 2 with one sentence naming the file or variable, the key and what
is allowed, before any kernel starts (run-all's command line, as a user types it)."""
import os
import subprocess
import sys
import time

import pytest

from gradkit import config

REPO = config.REPO_ROOT


def runall(tmp_path, *args, env=None, params=None):
    if params is not None:
        (tmp_path / "p.yaml").write_bytes(params if isinstance(params, bytes) else params.encode())
        args = (*args, "--params", str(tmp_path / "p.yaml"))
    e = {**os.environ, **(env or {})}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "gradkit.notebooks.runall", "04_bf16_leak", "--out",
                          str(tmp_path / "o"), "--no-progress", *args], cwd=str(REPO), env=e, capture_output=True, text=True, timeout=120)
    return out.returncode, out.stderr.strip(), time.monotonic() - t0


@pytest.mark.parametrize("params, words", [
    ("notebooks:\n  04_bf16_leak:\n    GA_VALUES: \"four\"\n", r"04_bf16_leak.ipynb .*GA_VALUES must be a non-empty list, got 'four'"),
    ("notebooks:\n  04_bf16_leak:\n    GA_VALUES: [1, 65]\n", "gradient accumulation steps must be an integer in 1..64, got 65"),
    ("notebooks:\n  04_bf16_leak:\n    VERSIONS: [\"0.18.9\\n\"]\n", r"a version must be 'installed' or a release number"),
    ("notebooks:\n  04_bf16_leak:\n    VERSIONS: [\"1.2abc\"]\n", r"got '1.2abc'"),
    ("notebooks:\n  04_bf16_leak:\n    SYMPTOM_SPLITS: [[4, 2, 1]]\n", r"a split is \[micro_batch, GA\]"),
    ("notebooks:\n  04_bf16_leak:\n    WORLD_SIZE: 99\n", "world_size=99 is more than this machine can run"),
    ("notebooks:\n  04_bf16_leak: [1, 2]\n", "notebooks.04_bf16_leak must map parameter names"),
    ("just a string\n", "must map 'defaults', 'notebooks' and 'timeouts', not hold a str"),
    ("defaults: {DEVICE: cpu\n", r"is not a YAML parameters file \(line"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "is not a YAML parameters file"),
    ("timeouts:\n  04_bf16_leak: -5\n", "timeouts.04_bf16_leak: timeout must be a number of seconds"),
])
def test_bad_parameters_exit_2_with_one_sentence_before_any_kernel(tmp_path, params, words):
    code, err, took = runall(tmp_path, params=params)
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert __import__("re").search(words, err), err
    assert not (tmp_path / "o" / "04_bf16_leak.ipynb").exists()  # no kernel ran


@pytest.mark.parametrize("env, words", [
    ({"GRADKIT_LAUNCHER": "bogus"}, "GRADKIT_LAUNCHER='bogus': use 'local', 'torchrun' or 'deepspeed'"),
    ({"GRADKIT_NNODES": "two"}, "GRADKIT_NNODES must be an integer"),
    ({"GRADKIT_SYNC_TIMEOUT_S": "-1"}, "GRADKIT_SYNC_TIMEOUT_S='-1'"),
    ({"GRADKIT_LAUNCER": "torchrun"}, "unknown variable(s) ['GRADKIT_LAUNCER']"),
])
def test_bad_environment_exits_2_naming_the_variable(tmp_path, env, words):
    code, err, _ = runall(tmp_path, env=env)
    assert code == 2 and words in err and len(err.splitlines()) == 1, err


def test_an_unusable_cache_or_out_folder_exits_2_and_leaves_nothing(tmp_path):
    (tmp_path / "a_file").write_text("x")
    code, err, _ = runall(tmp_path, env={"GRADKIT_CACHE": str(tmp_path / "a_file")})
    assert code == 2 and "GRADKIT_CACHE=" in err and "is a file, not a folder" in err, err
    code, err, _ = runall(tmp_path, "--out", str(tmp_path / "a_file" / "o"))  # under a file: even root cannot
    assert code == 2 and "cannot be written to" in err and len(err.splitlines()) == 1, err


def test_an_unknown_release_leaves_no_lock_file(tmp_path, monkeypatch):
    from gradkit.stacks import versions

    monkeypatch.setenv("GRADKIT_CACHE", str(tmp_path))
    with pytest.raises(versions.UnknownVersion, match="9.9.9"):
        versions.ensure_overlay("deepspeed", "9.9.9")
    assert not list((tmp_path / "overlays").glob(".*lock")), list((tmp_path / "overlays").iterdir())


def test_world_validation_leaves_no_world_folder(tmp_path, monkeypatch):
    import glob
    import tempfile

    from gradkit import launch

    monkeypatch.setenv("GRADKIT_CACHE", str(tmp_path / "a_file"))
    (tmp_path / "a_file").write_text("x")
    before = set(glob.glob(f"{tempfile.gettempdir()}/gradkit-world-*"))
    with pytest.raises(config.ConfigError, match="GRADKIT_CACHE"):
        launch.run_world("gradkit.launch.selftest:ping", {}, world_size=2, init="torch")
    assert set(glob.glob(f"{tempfile.gettempdir()}/gradkit-world-*")) == before
