"""What the watch keeps of a judged window (``gradkit.watch.capture``), on a module in this process: its docstring's
promises. A micro-batch per training forward (training mode, autograd on) while recording, nothing otherwise; the
arguments as the forward got them, detached copies; the random-number state and the autocast dtype it ran under; the
labels a ``compute_loss`` took out of the batch before the forward; the criterion's targets on the last micro-batch;
at most 64 batches fed ahead of their forwards; hooks gone after ``remove``."""
import collections

import torch
import torch.nn as nn

from gradkit.watch import capture


class Encoding:
    """A mapping that is no dict (transformers' BatchEncoding): ``items`` and ``keys``."""

    def __init__(self, **kw):
        self._d = kw

    def items(self):
        return self._d.items()

    def keys(self):
        return self._d.keys()


class ItemsOnly:
    def items(self):
        return [("a", 1)]


def test_the_arguments_are_kept_as_detached_copies_of_the_same_shape():
    Pair = collections.namedtuple("Pair", "x y")
    t = torch.ones(2, requires_grad=True)
    got = capture._detached({"a": [t, (t, 3)], "p": Pair(t, "s"), "e": Encoding(ids=t)})
    for x in (got["a"][0], got["a"][1][0], got["p"].x, got["e"]["ids"]):
        assert torch.equal(x, t) and x is not t and not x.requires_grad
    assert isinstance(got["a"], list) and isinstance(got["a"][1], tuple) and type(got["p"]) is Pair
    assert got["a"][1][1] == 3 and got["p"].y == "s" and isinstance(got["e"], dict)
    odd = ItemsOnly()
    assert capture._detached(odd) is odd  # not a mapping: kept as it is


def test_the_autocast_dtype_a_forward_ran_under_is_said_and_a_torch_that_cannot_say_is_none(monkeypatch):
    assert capture._autocast() is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert capture._autocast() == "bf16"
    with torch.autocast("cpu", dtype=torch.float16):
        assert capture._autocast() == "fp16"
    real = torch.is_autocast_enabled
    for error in (TypeError, RuntimeError, AttributeError):  # an older torch, a device it does not know
        def cuda_fails(device, error=error):
            if device == "cuda":
                raise error("no such device here")
            return real(device)
        monkeypatch.setattr(torch, "is_autocast_enabled", cuda_fails)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert capture._autocast() == "bf16", error  # the next device is still asked


def test_the_cuda_random_state_is_kept_only_where_cuda_is_up(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: "cuda state")
    for available, initialized, want in ((True, True, "cuda state"), (True, False, None), (False, True, None)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
        assert capture.rng_state()["cuda"] == want, (available, initialized)
    assert torch.equal(capture.rng_state()["cpu"], torch.get_rng_state())


def _recorder():
    model, crit = nn.Linear(3, 2), nn.MSELoss()
    return model, crit, capture.Recorder(model, crit)


def test_only_training_forwards_are_counted_and_only_a_started_window_records_them():
    model, crit, rec = _recorder()
    x = torch.randn(4, 3)
    assert rec.recording is False and rec.forwards == 0
    model(x)  # before start(): counted, not recorded
    assert rec.forwards == 1 and rec.window.micro_batches == []
    rec.start()
    model.eval()
    model(x)  # evaluation mode, autograd on
    model.train()
    with torch.no_grad():
        model(x)  # training mode, autograd off
    assert rec.forwards == 1 and rec.window.micro_batches == []
    crit(torch.zeros(4, 2), torch.ones(4, 2))  # a criterion call before any micro-batch: nothing to add it to
    model(x)
    model(x)
    crit(model(x), torch.ones(4, 2))
    window = rec.take()
    assert rec.forwards == 4 and len(window.micro_batches) == 3 and rec.recording is False
    first, last = window.micro_batches[0], window.micro_batches[-1]
    assert torch.equal(first.args[0], x) and first.targets is None and first.autocast is None
    assert torch.equal(last.targets[0][0], torch.ones(4, 2)) and last.targets[1] == {}
    model(x)
    crit(model(x), torch.ones(4, 2))
    assert rec.take().micro_batches == [] and rec.window.micro_batches == []
    rec.remove()
    rec.start()
    model(x)
    assert rec.forwards == 6 and rec.window.micro_batches == []  # no hook left


def test_labels_a_compute_loss_took_out_of_the_batch_come_from_the_batch_and_64_batches_are_kept_ahead():
    model, _, rec = _recorder()

    class Labelled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model

        def forward(self, x, labels=None, shift_labels=None):
            return self.lin(x)

    wrapped = Labelled()
    rec.remove()
    rec = capture.Recorder(wrapped)
    rec.start()
    x = torch.randn(2, 3)
    rec.fed({"input_ids": x, "labels": torch.tensor([1, 2]), "shift_labels": torch.tensor([3, 4])})
    wrapped(x)  # the labels were taken out: from the batch
    rec.fed({"labels": torch.tensor([5, 6])})
    wrapped(x, labels=torch.tensor([7, 8]))  # the forward's own are kept
    rec.fed(Encoding(labels=torch.tensor([9, 9])))  # no dict: not read
    wrapped(x)
    a, b, c = rec.take().micro_batches
    assert a.kwargs["labels"].tolist() == [1, 2] and a.kwargs["shift_labels"].tolist() == [3, 4]
    assert b.kwargs["labels"].tolist() == [7, 8] and "shift_labels" not in b.kwargs
    assert "labels" not in c.kwargs
    for i in range(64):
        rec.fed({"labels": torch.tensor([i])})
    assert len(rec.batches) == 64
    rec.fed({"labels": torch.tensor([64])})
    assert len(rec.batches) == 64 and rec.batches[0]["labels"].item() == 1  # the oldest went


def test_a_window_is_a_fresh_list_of_micro_batches_each_time():
    a, b = capture.Window(), capture.Window()
    assert a.micro_batches == [] and a.micro_batches is not b.micro_batches
