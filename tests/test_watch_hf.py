"""The watch's Trainer callback (``gradkit.watch.hf``) in this process, on transformers' own ``Trainer``: the batches
a loader makes also reach the watch (its collate function wrapped once; not with worker processes, which make them
elsewhere), and the callback's defaults taken from the Trainer's arguments: the records under
``<output_dir>/gradkit-watch``, the clip, the precision, the GA and token-averaging setting in every record; an
affected step stops training where asked. Real framework jobs on two ranks: test_recipes.py,
test_watch_trainer_jobs.py."""
import json
import sys
import types

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from gradkit.judge import oracle
from gradkit.watch import hf


def test_every_batch_a_loader_makes_reaches_the_watch_once_and_a_loader_with_workers_is_left_alone():
    fed = []
    loader = torch.utils.data.DataLoader(list(range(6)), batch_size=2)
    assert hf.feed(loader, fed.append) and hf.feed(loader, fed.append)  # the second changes nothing
    batches = [b.tolist() for b in loader]
    assert [b.tolist() for b in fed] == batches == [[0, 1], [2, 3], [4, 5]]
    accelerated = types.SimpleNamespace(base_dataloader=torch.utils.data.DataLoader([1, 2], batch_size=2))
    assert hf.feed(accelerated, fed.append) and accelerated.base_dataloader.collate_fn._gradkit_fed
    workers = torch.utils.data.DataLoader([1, 2], batch_size=2, num_workers=1)
    assert not hf.feed(workers, fed.append) and not getattr(workers.collate_fn, "_gradkit_fed", False)
    assert not hf.feed(types.SimpleNamespace(), fed.append)  # no collate function to wrap


def _llama(n_rows: int):
    """A tiny Llama (transformers' own class) and ``n_rows`` token rows of 8."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(0, 32, (8,), generator=g) for _ in range(n_rows)]


class Summing(Trainer):
    """A compute_loss that forgets to divide by the accumulation (the loss of the whole window's tokens, summed)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs) * self.args.gradient_accumulation_steps


def test_the_callback_takes_its_defaults_from_the_trainers_arguments_and_stops_on_an_affected_step(tmp_path):
    model, rows = _llama(12)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, save_strategy="no",
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
                             max_grad_norm=7.0)
    callback = hf.Callback(stop=True, every=1)
    trainer = Summing(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                      callbacks=[callback])
    trainer.train()
    recs = [json.loads(x) for x in (tmp_path / "gradkit-watch" / "watch.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "logged_norm" not in r]
    assert [r["verdict"] for r in steps] == [oracle.AFFECTED], [r["line"] for r in recs]  # stopped after step 1
    assert trainer.state.global_step == 1
    r = steps[0]
    assert r["trainer_ga"] == 2 and r["average_tokens_across_devices"] == args.average_tokens_across_devices
    assert r["loss"] == "mean over label tokens" and r["dtype"] == "fp32"
    assert r["versions"]["transformers"] and r["versions"]["accelerate"] and r["versions"]["torch"]
    assert callback.watch.recorder._handles == [] and callback.watch.clip == 7.0  # removed at the end; the clip


class _Watch:
    """A stand-in watch: what its step and its logged norm are judged."""

    def __init__(self, verdict):
        self.verdict, self.logged = verdict, []

    def step_end(self):
        return {"verdict": self.verdict}

    def judge_logged_norm(self, step, norm):
        self.logged.append((step, norm))
        return {"verdict": self.verdict}


def test_an_affected_step_or_logged_norm_stops_training_only_where_asked(monkeypatch, capsys):
    state, args = types.SimpleNamespace(global_step=3), None
    for stop in (False, True):
        for verdict in (oracle.AFFECTED, oracle.NOT_AFFECTED):
            cb = hf.Callback(stop=stop)
            cb.watch = _Watch(verdict)
            for call in (lambda c: cb.on_step_end(args, state, c), lambda c: cb.on_log(args, state, c,
                                                                                       logs={"grad_norm": 2.5})):
                control = types.SimpleNamespace(should_training_stop=False)
                assert call(control) is control
                assert control.should_training_stop is (stop and verdict == oracle.AFFECTED), (stop, verdict)
            assert cb.watch.logged == [(3, 2.5)]
    assert hf.Callback().stop is False  # judging never stops a job unless asked
    cb = hf.Callback(stop=True)
    control = types.SimpleNamespace(should_training_stop=False)
    assert cb.on_step_end(args, state, control) is control and cb.on_log(args, state, control, logs=None) is control
    cb.watch = _Watch(oracle.AFFECTED)
    cb.on_log(args, state, control, logs={"loss": 1.0})  # no norm logged: nothing judged
    assert cb.watch.logged == [] and control.should_training_stop is False


def test_a_watch_that_cannot_be_built_leaves_the_job_alone_and_a_loader_without_workers_is_fed(monkeypatch, capsys,
                                                                                                 tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    cb = hf.Callback(every=0)  # a Watch refuses it
    control = types.SimpleNamespace()
    assert cb.on_train_begin(args, None, control, model=torch.nn.Linear(2, 2), optimizer=None) is control
    assert cb.watch is None and "gradkit watch: cannot watch this job (" in capsys.readouterr().out
    fed = []
    plain = types.SimpleNamespace(collate_fn=lambda rows: rows)  # no num_workers: made in this process
    assert hf.feed(plain, fed.append) and plain.collate_fn([1]) == [1] and fed == [[1]]
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # a Trainer without DeepSpeed
    assert "deepspeed" not in hf.versions() and hf.versions()["transformers"]


class TakesLabels(Trainer):
    """A compute_loss that takes the labels out of the batch before the forward (as a custom loss does): the watch
    gets them from the batch the loader made."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def test_labels_a_compute_loss_takes_out_before_the_forward_reach_the_reference_from_the_loader(tmp_path):
    model, rows = _llama(4)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, save_strategy="no",
                             per_device_train_batch_size=2, gradient_accumulation_steps=1)
    callback = hf.Callback(every=1)
    TakesLabels(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                callbacks=[callback]).train()
    (r,) = [x for x in callback.watch.records if "logged_norm" not in x]
    assert r["verdict"] == oracle.NOT_AFFECTED, r["line"]  # the reference found its labels, and matches
