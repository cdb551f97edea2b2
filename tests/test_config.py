"""Bad input gets one clear error before anything is launched."""
import os

import pytest

from gradkit import config, launch
from gradkit.notebooks import runall, runall_params
from gradkit.probes import bf16_leak


@pytest.mark.parametrize("kwargs, words", [
    ({"world_size": 0}, "world_size"),
    ({"world_size": 10_000}, "more than this machine can run"),
    ({"ga_values": (0,)}, "gradient accumulation"),
    ({"ga_values": ()}, "GA_VALUES is empty"),
    ({"versions": ("not-a-version",)}, "release number"),
    ({"versions": ()}, "VERSIONS is empty"),
    ({"device": "tpu"}, "device must be"),
    ({"timeout_s": -1}, "timeout"),
])
def test_bad_b4_parameters_fail_fast(kwargs, words):
    args = dict(world_size=2, ga_values=(1, 2), versions=("installed",), device="cpu", timeout_s=60)
    args.update(kwargs)
    with pytest.raises(config.ConfigError, match=words):
        bf16_leak.validate(**args)


def test_run_validates_before_launching():
    with pytest.raises(config.ConfigError, match="world_size"):
        bf16_leak.run(world_size=os.cpu_count() * 100, ga_values=(1,))
    with pytest.raises(config.ConfigError, match="control"):
        bf16_leak.plan((1,), cases=("leak",))
    with pytest.raises(config.ConfigError, match="unknown B4 case"):
        bf16_leak.plan((1,), cases=("leak", "control", "nope"))


def test_unknown_zero_stage_and_dtype():
    with pytest.raises(config.ConfigError, match="unknown ZeRO stage 4"):
        config.check_zero_stage(4)
    with pytest.raises(config.ConfigError, match="dtype"):
        config.check_dtype("fp8")


def test_cuda_without_gpu_is_refused():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(config.ConfigError, match="no CUDA device"):
        launch.World(world_size=1, device="cuda").validate()


def test_symptom_splits_must_share_one_global_batch():
    with pytest.raises(config.ConfigError, match="global batch"):
        bf16_leak.plan_symptom([[4, 2], [2, 2]], steps=2, lr=0.1)


def test_unknown_papermill_parameter_is_refused(repo):
    nb = repo / "notebooks" / "04_bf16_leak.ipynb"
    runall_params.validate_parameters(nb, {"WORLD_SIZE": 2, "GA_VALUES": [1]})
    with pytest.raises(config.ConfigError, match="WORLD_SIZ"):
        runall_params.validate_parameters(nb, {"WORLD_SIZ": 2})


def test_runall_refuses_bad_params_file_before_running_anything(repo, tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("notebooks:\n  04_bf16_leak:\n    GA_VALUE: [1]\n")
    with pytest.raises(config.ConfigError, match="GA_VALUE"):
        runall.main([str(repo / "notebooks" / "04_bf16_leak.ipynb"), "--params", str(bad), "--out", str(tmp_path)])
    assert not (tmp_path / "04_bf16_leak.ipynb").exists()  # no notebook was run


def test_an_old_transformers_gets_companions_for_the_pins_it_checks(tmp_path):
    from gradkit.stacks import versions

    pkg = tmp_path / "transformers"
    pkg.mkdir()
    (pkg / "dependency_versions_table.py").write_text(
        'deps = {\n    "tokenizers": "tokenizers>=0.22.0,<=0.23.0",\n    "huggingface-hub": "huggingface-hub>=1.3.0,<2.0",'
        '\n    "torch": "torch>=2.2",\n}\n')
    assert versions.companion_requirements(tmp_path) == {"tokenizers": ">=0.22.0,<=0.23.0",
                                                         "huggingface-hub": ">=1.3.0,<2.0"}


def test_interactive_auto_follows_the_frontend(monkeypatch):
    monkeypatch.delenv(config.FRONTEND_ENV, raising=False)
    assert config.interactive("auto") is False and config.interactive(True) is True
    monkeypatch.setenv(config.FRONTEND_ENV, "notebooks/05_explorer.ipynb")  # what jupyter_server gives its kernels
    assert config.interactive("auto") is True and config.interactive(False) is False
    with pytest.raises(config.ConfigError, match="INTERACTIVE must be True, False or 'auto', got 'yes'"):
        config.interactive("yes")
