"""Model shapes (issue 23): every shape's correct step is `not-affected`, a loop that breaks one of its parameter
groups on purpose is `affected` with that group's fitted weights naming the lost part, and the user's own
architecture (a Hugging Face config at toy size, with a PEFT adapter) builds, runs and says what it shrank."""
import json
import os

import pytest
import torch

from gradkit import shapes
from gradkit.commands import check
from gradkit.judge import oracle, parts, records
from gradkit.probes import runner
from gradkit.probes import ds_config
from gradkit.probes.ranks import ds_config as ds_ranks
from gradkit.shapes import hf

pytestmark = pytest.mark.usefixtures("warm_module")

SHAPES = ("mlp", "frozen", "tied", "conditional", "no_grad_step")


def _case(name, model, loop="torch", fault=None, stale=False, **extra):
    cfg = {**({ds_ranks.LOOP_FAULT_KEY: fault} if fault else {}), **({ds_ranks.STALE_FAULT_KEY: True} if stale else {})}
    return {"name": name, "role": "control" if name.startswith("control") else "measured", "loop": loop, "ga": 4,
            "dtype": "fp32", "zero_stage": None, "steps": 3, "clip": 0.0, "model": model, "ds_config": cfg, **extra}


def _engine(model, stage, offload="none"):
    cfg = ds_config.resolve({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                             "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}}}, 2, 4,
                            "fp32")
    (case,) = [c for c in ds_config.plan(cfg, ("engine",), model=model)[0] if c["role"] == "measured"]
    return {**case, "name": f"{model} ZeRO-{stage}{' offload' if offload != 'none' else ''}"}


@pytest.fixture(scope="module")
def broken():
    """One world: per shape its control, and a plain-torch loop that breaks that shape's own parameters."""
    cases = [_case(f"control {m}", m) for m in SHAPES[1:]]
    cases += [_case("drop", "conditional", fault="drop:expert skip_last:1"),
              _case("train frozen", "frozen", fault="train_frozen"),
              _case("untie", "tied", fault="untie"),
              _case("stale", "no_grad_step", stale=True)]
    return runner.run(ds_config.CHECK, cases, [{}], (2,))


@pytest.fixture(scope="module")
def engines():
    """One world: DeepSpeed's own loop on every shape, ZeRO-2 (exact on 0.19.8) and ZeRO-3 (which is not, on a
    parameter that gets no gradient in a step), each next to a plain-torch control of its shape."""
    cases = [_case(f"control {m}", m) for m in SHAPES]
    cases += [_engine(m, 2) for m in SHAPES] + [_engine("no_grad_step", 3), _engine("conditional", 2, "cpu")]
    return runner.run(ds_config.CHECK, cases, [{}], (2,))


@pytest.mark.world
def test_every_shape_is_exact_in_deepspeeds_zero2_loop(engines):
    for m in SHAPES:
        c = records.one(engines, case=f"control {m}")
        assert c["verdict"] == oracle.NOT_AFFECTED, c["reason"]
        r = records.one(engines, case=f"{m} ZeRO-2")
        assert r["verdict"] == oracle.NOT_AFFECTED, (m, r["reason"])
        assert len(r["steps"]) == 3 and (m == "mlp") == ("groups" not in r["steps"][0])


@pytest.mark.world
def test_an_expert_that_lost_one_micro_batch_is_said_so(broken):
    r = records.one(broken, case="drop")
    assert r["verdict"] == oracle.AFFECTED, r["reason"]
    g = r["steps"][0]["groups"]
    assert g["expert skip_last"]["lost"] == "micro-batch 2 on every rank"
    assert all(g[e]["rel_err"] < 1e-5 for e in ("trunk", "expert skip_first", "expert only_first"))
    assert "expert skip_last: the gradient from micro-batch 2 on every rank was lost" in r["shape"]
    assert g["expert idle"]["expected_zero"] and g["expert idle"]["rel_err"] == 0.0


@pytest.mark.world
def test_trained_frozen_weights_and_an_untied_weight_are_said_so(broken):
    frozen = records.one(broken, case="train frozen")
    assert frozen["verdict"] == oracle.AFFECTED
    assert "frozen weights: updated by" in frozen["shape"] and "where its right update is 0" in frozen["shape"]
    assert frozen["steps"][0]["groups"]["adapters"]["rel_err"] < 1e-5  # the adapters themselves are right
    tied = records.one(broken, case="untie")
    assert tied["verdict"] == oracle.AFFECTED
    uses = tied["steps"][0]["groups"]["tied weight (embedding and head)"]["uses"]
    assert uses["names"] == ["embedding use", "head use"]
    assert uses["weights"] == pytest.approx([1.0, 0.0], abs=1e-4) and uses["residual"] < 1e-4
    assert "its gradient is embedding use x1, head use x0" in tied["shape"]


@pytest.mark.world
def test_a_parameter_with_no_gradient_in_a_step_keeps_its_weights(broken, engines):
    """Step 1 and 3 reach no micro-batch to the head: a loop that keeps the last gradient moves it at step 3, and so
    does DeepSpeed 0.19.8's ZeRO-3 (found by the sweep; a standalone script reproduces it)."""
    for r in (records.one(broken, case="stale"), records.one(engines, case="no_grad_step ZeRO-3")):
        assert r["verdict"] == oracle.AFFECTED, r["reason"]
        head = [st["groups"]["expert every_other_step"] for st in r["steps"]]
        assert head[0]["expected_zero"] and head[0]["rel_err"] == 0.0  # step 1: nothing to keep yet
        assert not head[1]["expected_zero"]
        assert head[2]["expected_zero"] and head[2]["rel_err"] > 0.5, head[2]
        assert "expert every_other_step: updated by" in r["steps"][2]["shape"]
        assert r["steps"][2]["parts"] == [parts.PART_STALE]
    assert check.explain(records.one(engines, case="no_grad_step ZeRO-3"))[0] == "B6"
    assert check.explain(records.one(broken, case="stale"))[0] is None  # no DeepSpeed there: no DeepSpeed bug named


@pytest.mark.world
def test_optimizer_offload_loses_what_the_boundary_micro_batch_does_not_reach(engines):
    """ZeRO-2 + offload_optimizer cpu, DeepSpeed's own loop (B7, found by the sweep): the experts that the last
    micro-batch of the window skips get no update at all."""
    r = records.one(engines, case="conditional ZeRO-2 offload")
    assert r["verdict"] == oracle.AFFECTED, r["reason"]
    g = r["steps"][0]["groups"]
    assert g["expert skip_last"]["rel_err"] == pytest.approx(1.0, abs=1e-6)  # nothing of it arrived
    assert g["expert only_first"]["rel_err"] == pytest.approx(1.0, abs=1e-6)
    assert g["expert skip_first"]["rel_err"] < 1e-5  # step 1: the part the boundary reaches is right
    assert parts.PART_LOST in r["parts"] and check.explain(r)[0] == "B7"


def test_group_judgement_finds_a_lost_micro_batch_and_a_move_where_none_belongs():
    torch.manual_seed(0)
    basis = torch.randn(4, 6, dtype=torch.float64)
    basis[1, 3:] = 0.0  # micro-batch 2 does not reach the second group
    w = torch.full((4,), 0.25, dtype=torch.float64)
    target = w @ basis
    step = target.clone()
    step[:3] -= 0.25 * basis[2, :3]  # the first group lost micro-batch 3
    step = torch.cat([step, torch.tensor([0.5], dtype=torch.float64)])  # a frozen weight moved
    full = torch.cat([basis, torch.zeros(4, 1, dtype=torch.float64)], dim=1)
    groups = {"a": torch.arange(0, 3), "b": torch.arange(3, 6), "frozen": torch.tensor([6])}
    g = parts.judge_groups(step, full, w, torch.cat([target, torch.zeros(1, dtype=torch.float64)]), groups, 1, 4)
    assert g["a"]["lost"] == "rank 0 micro-batch 3" and g["a"]["rel_err"] > 0.1
    assert g["b"]["reached"] == [0, 2, 3] and g["b"]["rel_err"] < 1e-12 and not g["b"].get("lost")
    assert g["frozen"]["expected_zero"] and g["frozen"]["rel_err"] == pytest.approx(0.5 / target.norm().item())
    judged = {"metrics": oracle.compare(step, torch.cat([target, torch.zeros(1, dtype=torch.float64)])),
              "dtype": "fp32", "groups": g}
    off = {s["signal"] for s in oracle.signals(judged) if not s["ok"]}
    assert {"rel. error of a", "misplaced weight of a", "rel. error of frozen"} <= off
    assert "rel. error of b" not in off


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "llama"])
def test_a_hugging_face_config_builds_at_toy_size_and_says_what_it_shrank(tmp_path, name):
    from transformers import AutoConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(AutoConfig.for_model(name).to_dict()))
    keys, notes = hf.user_model(str(path))
    assert keys["model_config"]["num_hidden_layers"] == 2 and keys["model_config"]["hidden_size"] == 32
    assert any(n.startswith("model: num_hidden_layers") and "-> 2" in n for n in notes)
    model = hf.shape(keys["model_config"]).build(0, 0, 0)
    assert model.config.model_type == name and sum(p.numel() for p in model.parameters()) < 100_000
    groups = hf.groups(model)
    assert sorted(n for g in groups.values() for n in g) == sorted(n for n, _ in model.named_parameters())
    if name == "qwen3_moe":
        assert "router" in groups and any(g.startswith("expert") for g in groups)


def test_a_model_id_whose_config_is_in_the_local_hugging_face_cache_builds_without_a_download(tmp_path):
    """``--model org/name`` reads the config from the local cache as huggingface_hub lays it out (refs/main names a
    snapshot), in a fresh process whose cache is that folder and which may not reach the hub."""
    import subprocess
    import sys

    from transformers import AutoConfig

    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen3"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    (snap / "config.json").write_text(json.dumps(AutoConfig.for_model("qwen3").to_dict()))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code = ("import json; from gradkit.shapes import hf; keys, notes = hf.user_model('tiny-org/tiny-qwen3'); "
            "print(json.dumps({'type': keys['model_config']['model_type'], "
            "'layers': keys['model_config']['num_hidden_layers'], 'notes': notes}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["type"] == "qwen3" and got["layers"] == 2
    assert any(n.startswith("model: num_hidden_layers") for n in got["notes"])
    missing = subprocess.run([sys.executable, "-c", code.replace("tiny-qwen3", "not-cached")], capture_output=True,
                             text=True, env=env, timeout=300)
    assert missing.returncode != 0 and "not a model whose config is in the local" in missing.stderr


def test_model_and_adapter_mistakes_exit_2_before_any_launch(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}))
    with pytest.raises(Exception, match="not a config file and not a model whose config is in the local"):
        check.main([str(cfg), "--model", "no-such-org/no-such-model"])
    with pytest.raises(Exception, match="--adapter needs --model"):
        check.main([str(cfg), "--model", "tied", "--adapter", str(cfg)])
    with pytest.raises(Exception, match="unknown model shape"):
        shapes.get("convolutional")


@pytest.mark.world
def test_check_on_a_moe_config_with_a_lora_adapter_runs_the_users_code_path(tmp_path, capsys):
    from transformers import AutoConfig

    model = tmp_path / "config.json"
    model.write_text(json.dumps(AutoConfig.for_model("qwen3_moe").to_dict()))
    adapter = tmp_path / "adapter_config.json"
    adapter.write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.1,
                                   "target_modules": ["q_proj", "v_proj"]}))
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                               "zero_optimization": {"stage": 2}}))
    out = tmp_path / "out.json"
    rc = check.main([str(cfg), "--model", str(model), "--adapter", str(adapter), "--loop", "engine,manual",
                     "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1, text  # the manual loop is B3, on the user's architecture too
    assert "model: qwen3_moe (from config.json)" in text and "model: num_hidden_layers" in text
    assert "adapter r 16 -> 4" in text and "lora_dropout 0.1 -> 0.0" in text
    loops = {r["loop"]: r for r in json.loads(out.read_text())["summary"]["loops"]}
    assert loops["engine"]["verdict"] == oracle.NOT_AFFECTED and loops["manual"]["explained_by"] == "B3"
    rec = next(r for r in json.loads(out.read_text())["records"] if r["case"] == "engine")
    assert set(rec["steps"][0]["groups"]) == {"adapters", "frozen weights"}
    assert rec["steps"][0]["groups"]["frozen weights"]["expected_zero"]
