"""``python -m gradkit.watch.attach`` (``gradkit.watch.attach``) in one process, no rank launched, on transformers' own
``Trainer``: its promise as its docstring states it. Every ``Trainer`` (and subclass) built after the attach gets
``Callback(**options)`` at the end of its ``__init__``, unless one is already in its callbacks; attaching again
changes nothing; where the callback cannot be added, or transformers cannot be imported, it says so and the job runs
without the watch; the target runs as ``__main__`` with its own arguments, and the Trainer it builds is judged. The
recipes that run real frameworks' entry points under it on 2 ranks are tests/test_recipes.py's."""
import json
import sys
import textwrap

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from gradkit.judge import oracle
from gradkit.watch import attach
from gradkit.watch.hf import Callback


class Own(TrainerCallback):
    """A callback of the job's own, given to its Trainer."""


class Framework(Trainer):
    """A framework's Trainer (TRL's, LLaMA-Factory's): its own ``__init__`` around the Trainer's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.built_by_the_framework = True


class Refusing(Trainer):
    """A Trainer that takes no callback from outside (its own, during its ``__init__``, it takes)."""

    def add_callback(self, callback):
        if isinstance(callback, Callback):
            raise RuntimeError("this trainer takes no callback")
        super().add_callback(callback)


def _ours(trainer) -> list:
    return [c for c in trainer.callback_handler.callbacks if isinstance(c, Callback)]


@pytest.fixture(autouse=True)
def restored(monkeypatch):
    """The attach's wrapper taken off ``Trainer.__init__`` after each test, and what ``main`` sets for its target
    (``sys.argv``, ``sys.path``) put back."""
    monkeypatch.setattr(Trainer, "__init__", Trainer.__init__)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))


@pytest.fixture
def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])


def test_every_trainer_built_after_the_attach_holds_one_watch_callback_last_with_the_attachs_options(args):
    model = torch.nn.Linear(2, 2)
    before = Trainer(model=model, args=args)
    assert _ours(before) == []  # built before: never changed
    said = []
    assert attach.attach({"every": 7, "layers": ("0.",), "stop": True}, log=said.append)
    for cls in (Trainer, Framework):
        trainer = cls(model=model, args=args, callbacks=[Own()])
        added = _ours(trainer)
        assert len(added) == 1, f"{cls.__name__}: {len(added)} gradkit callbacks"
        assert trainer.callback_handler.callbacks[-1] is added[0], \
            f"{cls.__name__}: the watch's callback is not the last: {trainer.callback_handler.callback_list}"
        assert added[0].options == {"every": 7, "layers": ("0.",)} and added[0].stop, added[0].options
        assert any(isinstance(c, Own) for c in trainer.callback_handler.callbacks)  # the job's own kept
    assert Framework(model=model, args=args).built_by_the_framework  # the framework's own __init__ ran whole
    assert _ours(before) == [] and said == []


def test_a_trainer_that_holds_a_watch_callback_keeps_it_alone_and_a_second_attach_changes_nothing(args):
    model = torch.nn.Linear(2, 2)
    assert attach.attach({"every": 3}) and attach.attach({"every": 9})
    trainer = Trainer(model=model, args=args)
    assert [c.options for c in _ours(trainer)] == [{"every": 3}], "the second attach added or changed a callback"
    own = Callback(first=1)
    trainer = Framework(model=model, args=args, callbacks=[own])
    assert _ours(trainer) == [own], f"the job's own watch callback and another: {[c.options for c in _ours(trainer)]}"


def test_a_trainer_that_refuses_the_callback_is_built_and_runs_without_the_watch_saying_so(args, monkeypatch):
    said = []
    assert attach.attach({}, log=said.append)
    trainer = Refusing(model=torch.nn.Linear(2, 2), args=args)
    assert _ours(trainer) == [] and len(said) == 1, said
    assert said[0].startswith("gradkit watch: cannot add its callback (RuntimeError: this trainer takes no callback)")
    assert said[0].endswith("training goes on without it"), said[0]
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where transformers is not installed
    said.clear()
    assert not attach.attach({}, log=said.append)
    assert len(said) == 1 and said[0].endswith("the job runs without the watch"), said


JOB = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    out, steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 32, (8,), generator=g) for _ in range(4 * steps)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=steps, save_strategy="no",
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    Path(out, "job.json").write_text(json.dumps({"argv": sys.argv[1:], "callbacks": names}))
""")


def test_the_attach_runs_its_target_as_main_with_its_own_arguments_and_the_trainer_it_builds_is_judged(tmp_path):
    """``main``: the options before the target are the callback's, the rest the target's own ``sys.argv``; the
    Trainer the target builds is judged at the steps asked (``--every 1``), its records where ``--out`` says."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "records"
    assert attach.main(["--every", "1", "--out", str(out), str(job), str(tmp_path), "2"]) == 0
    ran = json.loads((tmp_path / "job.json").read_text())
    assert ran["argv"] == [str(tmp_path), "2"] and ran["callbacks"].count("Callback") == 1, ran
    recs = [json.loads(x) for x in (out / "watch.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "logged_norm" not in r]
    assert [r["step"] for r in steps] == [1, 2], [r["line"] for r in recs]
    assert all(r["verdict"] == oracle.NOT_AFFECTED and r["loss"] == "mean over label tokens" for r in steps), \
        [r["line"] for r in steps]


def test_the_target_sees_what_python_would_give_it_and_the_wrapped_init_is_the_trainers_to_inspect(tmp_path,
                                                                                                   monkeypatch):
    """As ``python script.py`` / ``python -m module``: a script's own folder first on ``sys.path``; a module's
    ``sys.argv[0]`` its file and ``__main__`` itself; the arguments from ``sys.argv`` when ``main`` is given none.
    The wrapper keeps ``Trainer.__init__``'s name and signature (transformers and frameworks inspect it), and a
    second attach leaves the first wrapper in place."""
    import inspect

    original = Trainer.__init__
    seen = tmp_path / "seen.json"
    script = tmp_path / "scripted" / "job.py"
    script.parent.mkdir()
    report = ("import json, sys\nfrom pathlib import Path\n"
              f"Path({str(seen)!r}).write_text(json.dumps({{'path0': sys.path[0], 'argv': sys.argv, "
              "'main': sys.modules['__main__'].__dict__.get('__file__')}))\n")
    script.write_text(report)
    monkeypatch.setattr(sys, "argv", ["attach", "--every", "2", str(script), "a", "b"])
    assert attach.main() == 0
    got = json.loads(seen.read_text())
    assert got["path0"] == str(script.parent) and got["argv"] == [str(script), "a", "b"]
    (tmp_path / "pkg_attach_target").mkdir()
    (tmp_path / "pkg_attach_target" / "__init__.py").write_text("")
    (tmp_path / "pkg_attach_target" / "job.py").write_text(report)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert attach.main(["pkg_attach_target.job", "c"]) == 0
    got = json.loads(seen.read_text())
    module_file = str(tmp_path / "pkg_attach_target" / "job.py")
    assert got["argv"] == [module_file, "c"] and got["main"] == module_file
    wrapped = Trainer.__init__  # main attached it
    assert wrapped is not original and wrapped.__name__ == "__init__" and wrapped.__wrapped__ is original
    assert inspect.signature(wrapped) == inspect.signature(original)
    assert attach.attach({"every": 5}) and Trainer.__init__ is wrapped
