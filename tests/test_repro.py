"""The sweep's standalone reproduction (``gradkit.commands.repro``) without DeepSpeed: the script written for a record holds that
record's point, the shape of a step is read as multiples of the right weights, a reproduction is believed only by
its own judged line, and ``verify`` runs a script under torchrun as a user would (a stand-in script here: the
DeepSpeed one runs in tests/test_sweep.py's world test)."""
import ast
import json

import pytest

from gradkit import shapes
from gradkit.commands import repro
from gradkit.judge import tolerances


def _rec(dtype="fp32", judge=None, steps=None, model="mlp", loop="manual", ga=3, mb=2, w=2):
    case = {"ds_config": {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1,
                          "zero_optimization": {"stage": 2}}, "loop": loop, "ga": ga, "dtype": dtype, "model": model}
    if judge:
        case["judge_dtype"] = judge
    if steps:
        case["steps"] = steps
    return {"config": case, "world_size": w, "versions": {"deepspeed": "0.18.6"}}


def _constants(path) -> dict:
    """The script's module-level constants, read from its source (it is not run: it needs DeepSpeed)."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], (ast.Name, ast.Tuple)):
            names = [getattr(t, "id", None) for t in (node.targets[0].elts if isinstance(node.targets[0], ast.Tuple)
                                                      else [node.targets[0]])]
            try:
                values = ast.literal_eval(node.value)
            except ValueError:
                continue
            out.update(zip(names, values if len(names) > 1 else [values]))
    return out


@pytest.mark.parametrize("dtype, judge", [("fp32", None), ("bf16", None), ("fp32", "bf16")])
def test_the_script_runs_the_records_point_with_its_dtypes_limits(tmp_path, dtype, judge):
    rec = _rec(dtype, judge, steps=3, ga=3, mb=2, w=2)
    path = repro.write(rec, tmp_path / "repro_x.py", "a title")
    text = path.read_text()
    compile(text, str(path), "exec")  # a script that runs
    k = _constants(path)
    limits = tolerances.tolerance(judge or dtype)
    assert (k["LOOP"], k["N"], k["MB"], k["STEPS"]) == ("manual", 3, 2, 3)
    assert (k["TOL"], k["MISPLACED"], k["ROUND"]) == (limits.rel_l2, limits.misplaced_weight, tolerances.ROUNDING[dtype])
    assert text.startswith('"""a title\n') and "--nproc_per_node=2 repro_x.py" in text and "(0.18.6 here)" in text
    assert shapes.get("mlp").source() in text and "ROUTED = False" in text
    assert "needs only torch and deepspeed (0.18.6 here).\n" in text
    assert json.loads(ast.literal_eval(text.split("CONFIG = json.loads(")[1].split(")\n")[0])) == \
        rec["config"]["ds_config"]


def test_the_same_point_writes_the_same_script_whatever_the_order_of_its_config_keys(tmp_path):
    rec = _rec()
    flipped = json.loads(json.dumps(rec))
    flipped["config"]["ds_config"] = dict(reversed(list(rec["config"]["ds_config"].items())))
    assert repro.write(rec, tmp_path / "a.py", "t").read_text() == repro.write(flipped, tmp_path / "a.py", "t").read_text()


def test_a_record_without_a_step_count_is_one_step_and_a_routed_model_says_so(tmp_path):
    assert _constants(repro.write(_rec(), tmp_path / "a.py", "t"))["STEPS"] == 1
    text = repro.write(_rec(model="conditional"), tmp_path / "b.py", "t").read_text()
    assert "ROUTED = True" in text and shapes.get("conditional").source() in text
    text = repro.write(_rec(model="frozen"), tmp_path / "c.py", "t").read_text()  # a PEFT LoRA model
    assert "needs only torch and deepspeed (0.18.6 here) and peft.\n" in text


def test_the_shape_of_a_step_is_each_weight_as_a_multiple_of_its_right_one():
    a = {"weights": [0.0, 0.25, -0.0, 0.5, 0.125, 0.0, 9.0], "expected_weights": [0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0],
         "residual": 0.01}
    got = repro.shape_of({"attribution": a, "world_size": 2, "ga": 3})
    assert got == {"weights": [0.0, 1.0, 0.0, 2.0, 0.8, 0.0], "residual": 0.01}  # a weight-0 row: x (W N) instead
    assert str(got["weights"][2]) == "0.0"  # never -0.0
    assert repro.shape_of({"attribution": {**a, "residual": 0.0}, "world_size": 1, "ga": 2}) == \
        {"weights": [0.0, 1.0], "residual": 0.0}
    half = repro.shape_of({"attribution": {"weights": [0.125, 0.25], "expected_weights": [0.25, 0.25]}, "world_size": 1,
                           "ga": 2})
    assert half["weights"] == [0.5, 1.0]  # to a tenth, not to a whole
    third = repro.shape_of({"attribution": {"weights": [1 / 12, 0.25], "expected_weights": [0.25, 0.25]},
                            "world_size": 1, "ga": 2})
    assert third["weights"] == [0.3, 1.0]  # to a tenth, not to a hundredth
    no_residual = {k: v for k, v in a.items() if k != "residual"}
    assert repro.shape_of({"attribution": no_residual, "world_size": 1, "ga": 1})["residual"] == 0.0


def _line(steps, reproduced=True):
    return json.dumps({"deepspeed": "0.18.6", "steps": steps, "reproduced": reproduced})


def _st(weights, off=True, residual=0.0):
    return {"off": off, "weights_x_right": weights, "residual": residual}


@pytest.mark.parametrize("steps, shape, want", [
    ([_st([0.0, 1.0])], {"weights": [0.0, 1.0], "residual": 0.0}, True),
    ([_st([0.14, 0.86])], {"weights": [0.0, 1.0], "residual": 0.0}, True),             # within the 0.15 tolerance
    ([_st([0.16, 1.0])], {"weights": [0.0, 1.0], "residual": 0.0}, False),             # just outside it
    ([_st([0.0, 1.0], off=False), _st([1.0, 1.0])], {"weights": [0.0, 1.0], "residual": 0.0}, False),
    ([_st([1.0, 1.0]), _st([0.0, 1.0])], {"weights": [0.0, 1.0], "residual": 0.0}, True),  # a later step matches
    ([_st([0.0, 1.0], off=False), _st([0.0, 1.0])], {"weights": [0.0, 1.0], "residual": 0.0}, True),  # after one in
    ([_st([0.0, 1.0, 0.0])], {"weights": [0.0, 1.0], "residual": 0.0}, False),        # another world's shape
    ([_st([0.0, 1.0], residual=0.2)], {"weights": [0.0, 1.0], "residual": 0.0}, False),  # not a structural step
    ([_st([5.0, 5.0], residual=0.2)], {"weights": [0.0, 1.0], "residual": 0.3}, True),   # both beyond the basis
    ([_st([0.0, 1.0], residual=0.0)], {"weights": [0.0, 1.0], "residual": 0.3}, False),
    ([_st([0.0, 1.0], residual=repro.STRUCTURAL)], {"weights": [0.0, 1.0], "residual": 0.3}, True),  # at the limit
    ([_st([0.0, 1.0], residual=0.2)], {"weights": [0.0, 1.0], "residual": repro.STRUCTURAL}, True),
    ([_st([0.0, 1.0], residual=repro.STRUCTURAL)], {"weights": [0.0, 1.0], "residual": 0.0}, False),  # at the limit
    ([_st([0.15, 1.0])], {"weights": [0.0, 1.0], "residual": 0.0}, True),              # exactly at the tolerance
    ([{"off": True, "weights_x_right": [0.0, 1.0]}], {"weights": [0.0, 1.0], "residual": 0.0}, True),  # no residual: 0
    ([{"off": True, "weights_x_right": [0.0, 1.0]}], {"weights": [0.0, 1.0], "residual": 0.3}, False),
    ([], {"weights": [0.0, 1.0], "residual": 0.0}, False),
])
def test_a_reproduction_needs_an_off_step_of_the_groups_shape(steps, shape, want):
    assert repro.reproduced(1, _line(steps), shape) is want


def test_a_reproduction_without_a_shape_is_its_own_judgement_and_exit_status():
    assert repro.reproduced(1, "noise\n" + _line([]) + "\nREPRODUCED") is True
    assert repro.reproduced(1, _line([], reproduced="yes")) is False  # only a JSON true
    assert repro.reproduced(2, _line([])) is False and repro.reproduced(0, _line([])) is False
    assert repro.said("x\n" + _line([]) + "\n") == {"deepspeed": "0.18.6", "steps": [], "reproduced": True}
    assert repro.said(" " + _line([])) is None  # the judged line starts the line
    assert repro.said(_line([]) + "\n" + _line([])) is None


STAND_IN = '''import json, os, sys
rank = int(os.environ["RANK"])
if rank == 0:
    print("some noise")
    print(json.dumps({"deepspeed": "stand-in", "world": int(os.environ["WORLD_SIZE"]), "cpu": os.environ.get(
        "DS_ACCELERATOR"), "threads": os.environ.get("OMP_NUM_THREADS"), "reproduced": True}), flush=True)
    print("REPRODUCED: a stand-in", flush=True)
    print("a line that says reproduced is kept", flush=True)
sys.exit(1)
'''


def test_verify_runs_the_script_under_torchrun_in_the_stacks_environment_and_keeps_its_judged_lines(tmp_path,
                                                                                                    monkeypatch):
    from gradkit.stacks import versions

    asked = []
    real = versions.resolve_stack
    monkeypatch.setattr(versions, "resolve_stack", lambda stack, packages: asked.append(stack) or real({}, packages))
    script = tmp_path / "repro_stand_in.py"
    script.write_text(STAND_IN)
    rc, output = repro.verify(script, stack={"deepspeed": "0.18.6"}, timeout_s=120)  # 2 ranks by default
    assert rc == 1, output
    assert asked == [{"deepspeed": "0.18.6"}]
    lines = output.splitlines()
    assert "some noise" not in output and lines[1:] == ["REPRODUCED: a stand-in", "a line that says reproduced is kept"]
    assert json.loads(lines[0]) == {"deepspeed": "stand-in", "world": 2, "cpu": "cpu", "threads": "1", "reproduced": True}
    assert repro.reproduced(rc, output)
    rc, output = repro.verify(script, world_size=1, device="cuda", timeout_s=120)  # a GPU run: no DS_ACCELERATOR
    assert json.loads(output.splitlines()[0])["cpu"] is None and asked[-1] == {}


def test_a_script_that_judges_nothing_gives_the_end_of_what_it_printed(tmp_path):
    script = tmp_path / "repro_silent.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '0':\n    sys.stdout.write('A' * 3000)\n")
    rc, output = repro.verify(script, world_size=1, timeout_s=120)
    assert rc == 0 and output.endswith("A") and len(output) == 2000 and not repro.reproduced(rc, output)



def test_a_rank_that_crashes_shows_its_traceback_though_torchruns_summary_and_later_output_fill_the_tail(tmp_path):
    script = tmp_path / "repro_crash.py"
    script.write_text("import os, sys, time, traceback\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    try:\n        raise RuntimeError('rank 1 fell over here')\n"
                      "    except RuntimeError:\n        traceback.print_exc()\n"
                      "    sys.stderr.write('B' * 3000 + '\\n'); sys.exit(1)\n"
                      "time.sleep(60)\n")
    rc, output = repro.verify(script, world_size=2, timeout_s=120)
    assert rc == 1 and not repro.reproduced(rc, output)
    head, tail = output.split("\n[...]\n")
    assert head.startswith(repro.TRACEBACK) and "RuntimeError: rank 1 fell over here" in head, output
    assert len(tail) == 2000 and "B" * 100 not in tail[-300:]  # the tail: torchrun's summary after the rank's output


T = repro.TRACEBACK


@pytest.mark.parametrize("output, want", [
    ("A" * 3000, "A" * 2000),  # no traceback: the tail
    ("A" * 500 + T + "B" * 1000, "A" * 500 + T + "B" * 1000),  # all of it is shorter than the tail
    ("A" * 1000 + T + "B" * 1966, "A" + T + "B" * 1966),  # the traceback starts inside the tail: the tail
    ("A" * 100 + T + "B" * 2500, T + "B" * 2500),  # it runs into the tail: one piece
    ("A" * 100 + T + "B" * 1967 + "C" * 2000, T + "B" * 1967 + "C" * 2000),  # it just reaches the tail: one piece
    ("A" * 100 + T + "B" * 1968 + "C" * 2000, T + "B" * 1967 + "\n[...]\n" + "C" * 2000),  # one character between
    ("A" * 100 + T + "B" * 5000 + "C" * 2000, T + "B" * (2000 - len(T)) + "\n[...]\n" + "C" * 2000),
])
def test_a_run_without_a_judgement_keeps_the_first_traceback_and_the_tail(output, want):
    assert repro.unjudged(output) == want

def _running(script) -> list:
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]


def test_verify_stops_a_script_that_hangs_at_its_timeout_and_leaves_none_of_its_ranks(tmp_path):
    script = tmp_path / "repro_hang.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '0':\n    print('A' * 3000, flush=True)\ntime.sleep(600)\n")
    rc, output = repro.verify(script, world_size=2, timeout_s=6)
    assert rc == 124 and output.startswith("timed out after 6 s: 'A") and not repro.reproduced(rc, output)
    assert output.count("A") == 1999  # the last 2000 characters of what it printed (its last newline included)
    assert _running(script) == []  # torchrun's ranks run in sessions of their own: killed with it
