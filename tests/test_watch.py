"""The watch in one process (no world): a user's own torch loop, correct or with a defect planted in the loop, judged
step by step against the exact gradient of its global batch; the schedule; the records; the sketch's fitted weights
against exact ones; the control catching a read that misses or misplaces a piece; an fp16 loss scale that changed
before a step's read, and a step its scaler skipped. The watch on DeepSpeed's engines, in real 2-rank jobs, is
tests/test_watch_jobs.py."""
import json

import pytest
import torch
import torch.nn as nn

from gradkit.judge import oracle
from gradkit.watch import Affected, Watch, reads, watch_engine
from gradkit.watch.judge import SCALE_GREW, STALE
from gradkit.watch.sketch import Sketch


def _job(defect=None, steps=3, ga=4, tmp=None, clip=None, **watch):
    """A small regression job: AdamW, dropout, micro-batches of 3..6 samples, loss = each micro-batch's mean weighted
    by its share of the window's samples (a mean over samples), ``defect`` planted in the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    crit = nn.MSELoss()
    w = Watch(model, opt, criterion=crit, out=tmp or "gradkit-watch-test", clip=clip, **{"log": None, **watch})
    data = torch.Generator().manual_seed(1)
    sizes = [3 + m for m in range(ga)]
    for step in range(steps):
        for m in range(ga):
            x, y = torch.randn(sizes[m], 8, generator=data), torch.randn(sizes[m], 2, generator=data)
            loss = crit(model(x), y)
            (loss if defect == "sum" else loss * sizes[m] / sum(sizes)).backward()
        if defect == "request" and step == 3:
            w.request()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if defect != "keep":
            opt.zero_grad()
    return w


def test_a_correct_loop_is_not_affected_on_every_signal_at_every_judged_step(tmp_path):
    w = _job(tmp=tmp_path, every=3, steps=4)
    assert [r["step"] for r in w.records] == [1, 2, 3]
    for r in w.records:
        m = r["measured"]["metrics"]
        assert r["verdict"] == oracle.NOT_AFFECTED, r["line"]
        assert abs(m["norm_ratio"] - 1) < 1e-5 and m["cosine"] > 1 - 1e-7 and m["rel_l2"] < 1e-5
        assert r["measured"]["attribution"]["misplaced_weight"] < 1e-5  # dropout replayed: the same masks
        assert r["global_count"] == 3 + 4 + 5 + 6 and r["ga"] == 4 and r["loss"] == "mean over samples"


def test_a_loop_that_sums_its_micro_batches_is_affected_and_its_step_named(tmp_path):
    w = _job("sum", tmp=tmp_path, steps=2)
    for r in w.records:
        assert r["verdict"] == oracle.AFFECTED and r["matches"] == "sum of micro-batches", r["line"]
        weights = r["measured"]["attribution"]["weights"]
        assert weights[:4] == pytest.approx([1.0] * 4, abs=1e-5)  # each micro-batch's mean, whole
        assert "micro-batch" in r["shape"] and "ratio" in r["line"]


def test_a_gradient_kept_into_the_next_step_is_named_there(tmp_path):
    w = _job("keep", tmp=tmp_path, steps=2)
    assert [r["verdict"] for r in w.records] == [oracle.NOT_AFFECTED, oracle.AFFECTED]
    assert w.records[1]["matches"] == STALE
    weights = w.records[1]["measured"]["attribution"]["weights"]
    assert weights[4:] == pytest.approx([n / 18 for n in (3, 4, 5, 6)], abs=1e-5)  # the previous step's, whole


def test_only_the_chosen_steps_are_judged_and_a_request_adds_the_next(tmp_path):
    w = _job("request", tmp=tmp_path, steps=9, every=4, first=1, poll=0)
    assert [r["step"] for r in w.records] == [1, 4, 5, 8]  # step 5 on request (asked during step 4)
    (tmp_path / "judge-next").write_text("")
    w2 = _job(tmp=tmp_path / "b", steps=3, every=0, first=1, poll=1)
    assert [r["step"] for r in w2.records] == [1]
    (tmp_path / "b" / "judge-next").write_text("")
    w3 = _job(tmp=tmp_path / "b", steps=3, every=0, first=0, poll=1)
    assert [r["step"] for r in w3.records] == [1] and not (tmp_path / "b" / "judge-next").exists()


def test_each_judged_step_is_one_record_and_one_log_line(tmp_path):
    lines = []
    w = _job(tmp=tmp_path, steps=2, log=lines.append)
    recs = [json.loads(x) for x in (tmp_path / "watch.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and lines == [r["line"] for r in w.records]
    assert lines[0].startswith("gradkit watch: step 1: not-affected (ratio 1.0000")


def test_an_affected_step_stops_the_job_where_asked(tmp_path):
    with pytest.raises(Affected, match="step 1: affected"):
        _job("sum", tmp=tmp_path, stop=True)


def test_a_subset_of_layers_is_judged_alone(tmp_path):
    w = _job(tmp=tmp_path, steps=1, layers=("0.",))
    assert w.records[0]["judged_parameters"] == 2 and w.records[0]["verdict"] == oracle.NOT_AFFECTED
    w = _job("sum", tmp=tmp_path, steps=1, layers=("3.",))
    assert w.records[0]["judged_parameters"] == 2 and w.records[0]["verdict"] == oracle.AFFECTED


def test_the_sketched_fit_is_the_exact_fit(tmp_path):
    """Fitted weights from 4096-number sketches of 12 gradients of 200k coordinates against the exact least squares:
    equal to 1e-9 where the vector is a combination of them (as every accumulation bug leaves it), and within 1e-3
    with noise of 1e-2 of its norm on top (bf16's size)."""
    torch.manual_seed(0)
    numels = [150_000, 50_000]
    s = Sketch(numels)
    basis = torch.randn(12, sum(numels), dtype=torch.float64)
    true = torch.rand(12, dtype=torch.float64)
    for noise, tol in ((0.0, 1e-9), (1e-2, 1e-3)):
        v = true @ basis
        v = v + noise * v.norm() / v.numel() ** 0.5 * torch.randn_like(v)
        exact = torch.linalg.lstsq(basis.T, v.unsqueeze(1)).solution.squeeze(1)
        sk = lambda x: s.of(list(x.split(numels)))  # noqa: E731
        fit = oracle.attribute(sk(v), torch.stack([sk(b) for b in basis]), true)["weights"]
        assert fit == pytest.approx(exact.tolist(), abs=tol)


@pytest.mark.parametrize("fault", ["shifted", "missing"])
def test_the_control_catches_a_read_that_misplaces_or_misses_a_piece(tmp_path, monkeypatch, fault):
    real = reads.Layout.fragments

    def wrong(self, current):
        out = real(self, current)
        if fault == "missing":
            return out[1:]
        t, start, v = out[0]
        return [(t, start + 1, v[:-1])] + out[1:]

    monkeypatch.setattr(reads.Layout, "fragments", wrong)
    w = _job(tmp=tmp_path, steps=1)
    assert w.records[0]["verdict"] == oracle.INCONCLUSIVE and "control" in w.records[0]["why"]


def test_the_consumed_gradient_is_read_in_the_innermost_torch_optimizer():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1)

    class Wrapper:
        def __init__(self, o):
            self.optimizer = o

    assert reads.innermost(Wrapper(Wrapper(opt))) is opt
    with pytest.raises(TypeError, match="no torch.optim.Optimizer"):
        reads.innermost(object())


def test_gradkit_report_writes_a_real_jobs_affected_steps_and_refuses_a_clean_one(tmp_path, capsys):
    from gradkit import config
    from gradkit.commands import report

    _job("sum", tmp=tmp_path / "bad", steps=2)
    assert report.main([str(tmp_path / "bad")]) == 0
    text = (tmp_path / "bad" / "report.md").read_text()
    assert text.startswith("# [torch ") and "is sum of micro-batches (norm ratio" in text
    assert text.count("| affected | ") == 2 and "## Reproduction" in text
    _job(tmp=tmp_path / "good", steps=1)
    with pytest.raises(config.ConfigError, match="no affected step to report"):
        report.main([str(tmp_path / "good" / "watch.jsonl")])


def test_a_forward_patched_onto_the_model_is_not_the_reference(tmp_path):
    """TRL patches ``model.forward`` on the instance (its fused LM head: ``fused_lm_head=True`` returns per-token
    log-probabilities, no logits). That method is bound to the user's model: a copy that kept it would run the user's
    model, not the copy. The reference runs the class's own forward, without the keywords only the patch takes."""
    import types

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.out = nn.Linear(6, 12), nn.Linear(12, 6)
            self.squash = self._squash  # a method kept as an attribute: the copy calls its own

        def _squash(self, x):
            return torch.tanh(self.body(x))

        def forward(self, input_ids):
            return self.out(self.squash(nn.functional.one_hot(input_ids, 6).float()))

    torch.manual_seed(0)
    model = Head()
    original = model.forward

    def fused(self, *args, fused_lm_head=False, labels=None, **kwargs):  # the model's loss, by another route
        if not fused_lm_head:
            return original(*args, **kwargs)
        logits = self.out(torch.tanh(self.body(nn.functional.one_hot(args[0], 6).float())))[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, labels[:, 1:, None].clamp(min=0))[..., 0]
        return -(lp * (labels[:, 1:] != -100)).sum()

    model.forward = types.MethodType(fused, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = Watch(model, opt, out=str(tmp_path), log=None)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        rows = [torch.randint(0, 6, (2, 7), generator=g) for _ in range(2)]
        count = sum(int((r[:, 1:] != -100).sum()) for r in rows)
        for r in rows:
            (model(r, fused_lm_head=True, labels=r) / count).backward()
        opt.step()
        opt.zero_grad()
    assert [r["verdict"] for r in w.records] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in w.records]
    assert w.records[0]["loss"] == "mean over label tokens"
    assert w.records[0]["measured"]["metrics"]["rel_l2"] < 1e-5


def test_a_reference_the_model_refuses_is_cannot_run_and_the_job_goes_on(tmp_path):
    """A model whose forward fails on the copy (here: its input checked against the user's own module) is said,
    ``cannot-run`` with the model's own sentence, never raised into the user's training loop."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    original = model

    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            if self.inner is not original:
                raise RuntimeError("only the one true module may run")
            return self.inner(x)

    top, crit = Picky(), nn.MSELoss()
    opt = torch.optim.SGD(top.parameters(), lr=0.1)
    w = Watch(top, opt, criterion=crit, out=str(tmp_path), log=None)
    for _ in range(3):
        crit(top(torch.randn(3, 4)), torch.randn(3, 2)).backward()
        opt.step()
        opt.zero_grad()
    assert [r["verdict"] for r in w.records] == [oracle.CANNOT_RUN] * 2
    assert "RuntimeError: only the one true module may run" in w.records[0]["why"]


def test_a_judged_step_that_would_take_the_jobs_memory_is_not_judged_and_the_job_goes_on(tmp_path, monkeypatch):
    """The reference's memory is asked for before it is taken (``reference.room``): where the host has less free
    than the copy needs, the step is ``cannot-run`` with both numbers, and the job's own steps are as without it."""
    import collections

    import psutil

    from gradkit.watch import reference

    clean = _job(tmp=tmp_path / "clean", steps=2)
    real = psutil.virtual_memory
    monkeypatch.setattr(reference.psutil, "virtual_memory",
                        lambda: collections.namedtuple("Mem", "available")(1000))  # 1000 bytes free
    short = _job(tmp=tmp_path / "short", steps=2)
    assert [r["verdict"] for r in short.records] == [oracle.CANNOT_RUN] * 2
    assert "GiB is free for it: the step is not judged" in short.records[0]["why"], short.records[0]["why"]
    assert all(torch.equal(a, b) for a, b in zip(clean.model.state_dict().values(), short.model.state_dict().values()))
    monkeypatch.setattr(reference.psutil, "virtual_memory", real)
    assert [r["verdict"] for r in clean.records] == [oracle.NOT_AFFECTED] * 2  # the control: room, then judged


def test_a_second_run_into_the_same_folder_keeps_the_first_runs_records_aside(tmp_path):
    """Records of two runs in one file would be read as one run's (``gradkit report``, notebook 09): the second run
    moves the first's file aside, whole, and writes its own."""
    first = _job(tmp=tmp_path, steps=2)
    second = _job("sum", tmp=tmp_path, steps=1)
    now = [json.loads(x) for x in (tmp_path / "watch.jsonl").read_text().splitlines()]
    assert [r["verdict"] for r in now] == [r["verdict"] for r in second.records] == [oracle.AFFECTED]
    kept = list(tmp_path.glob("watch-*.jsonl"))
    assert len(kept) == 1 and [json.loads(x)["step"] for x in kept[0].read_text().splitlines()] == \
        [r["step"] for r in first.records] == [1, 2]


def test_a_wrong_step_clipped_by_its_own_norm_is_still_named(tmp_path):
    """Clipping scales the step the engine accumulated by that step's own norm: a loop that sums its micro-batches
    (about 4x the gradient) is clipped back to the clip norm while the right step (under it) is not. The applied step
    has the summed direction at the clip's norm, and is named so, not left unnamed for its scale."""
    ref = _job(tmp=tmp_path / "ref", steps=1).records[0]["measured"]["metrics"]["reference_norm"]
    clip = 2 * ref  # above the right step's norm, below the summed one's
    w = _job("sum", tmp=tmp_path / "sum", steps=2, clip=clip)
    for r in w.records:
        m = r["measured"]["metrics"]
        assert r["verdict"] == oracle.AFFECTED and r["clip_coef"] == 1.0, r["line"]
        assert m["effective_norm"] == pytest.approx(clip, rel=1e-5)
        assert r["matches"] == "sum of micro-batches", r["line"]


class _Fp16Scaler:
    """An fp16 optimizer with a dynamic loss scale as the watch sees DeepSpeed's: a wrapper holding the torch
    optimizer (``.optimizer``) and its scale (``loss_scale``), each loss multiplied by it before its backward. Its
    ``step(what)``: "clean" unscales the gradients by the scale and steps; "overflow" skips the step (nothing
    applied) and halves the scale; "grow late" steps, then doubles the scale (a scaler that unscales first);
    "grow early" doubles it and "shrink early" halves it before the gradients are unscaled (DeepSpeed's B10 is the
    growth): the step applied is then the gradient x old / new scale."""

    def __init__(self, optimizer, scale: float):
        self.optimizer, self.loss_scale = optimizer, scale

    def step(self, what: str) -> bool:
        """Whether the step was skipped."""
        if what == "overflow":
            self.loss_scale /= 2
            return True
        self.loss_scale *= {"grow early": 2.0, "shrink early": 0.5}.get(what, 1.0)
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                p.grad.div_(self.loss_scale)
        self.optimizer.step()
        if what == "grow late":
            self.loss_scale *= 2
        return False


class _Fp16Engine:
    """DeepSpeed's engine on fp16 as ``watch_engine`` drives it (its ZeRO-2 loop, one ``step()`` at each boundary):
    its module, its fp16 optimizer, ``skipped_steps`` counting the steps its scaler skipped."""

    def __init__(self, module, optimizer, ga: int):
        self.module, self.optimizer, self.ga, self.skipped_steps = module, optimizer, ga, 0
        self.plan = iter(())

    def bfloat16_enabled(self):
        return False

    def fp16_enabled(self):
        return True

    def zero_optimization_stage(self):
        return 2

    def gradient_accumulation_steps(self):
        return self.ga

    def gradient_clipping(self):
        return 0.0

    def is_gradient_accumulation_boundary(self):
        return True

    def step(self):
        self.skipped_steps += self.optimizer.step(next(self.plan))


SCALED_STEPS = ("clean", "grow early", "clean", "overflow", "clean", "grow late", "clean", "shrink early")


@pytest.mark.parametrize("driven_by", ["step_end", "watch_engine"])
def test_a_step_whose_loss_scale_changed_before_its_read_is_named_and_a_skipped_step_is_said(tmp_path, driven_by):
    """fp16's dynamic loss scale (docs/watch.md): a step whose scale changed between its backward passes and its
    read applies the gradient x old / new scale, affected and named 'global mean x old / new loss scale', its record
    stating the change (0.5 where it doubled, 2 where it halved); a scale that changes before the step's first
    backward (after an overflow, or after the previous step's growth) or after its read changes nothing of the step:
    not-affected, no change stated; a step the scaler skipped on an overflow applied nothing and is said
    ``skipped``, never judged. Driven as the Trainer's callback drives it (``step_end()`` after each step, a skip
    seen as nothing consumed) and as ``watch_engine`` does (the engine's ``skipped_steps``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler, crit = _Fp16Scaler(opt, 1024.0), nn.MSELoss()
    options = dict(criterion=crit, out=tmp_path, every=1, poll=0, log=None)
    if driven_by == "watch_engine":
        engine = watch_engine(_Fp16Engine(model, scaler, 4), **options)
        engine.plan, w = iter(SCALED_STEPS), engine.gradkit_watch
    else:
        w = Watch(model, scaler, finalize_on_post=False, **options)
    data = torch.Generator().manual_seed(1)
    sizes = [3, 4, 5, 6]
    for what in SCALED_STEPS:
        for n in sizes:
            x, y = torch.randn(n, 8, generator=data), torch.randn(n, 2, generator=data)
            (crit(model(x), y) * n / sum(sizes) * scaler.loss_scale).backward()
        if driven_by == "watch_engine":
            engine.step()
        else:
            scaler.step(what)
            w.step_end()
        opt.zero_grad()
    recs = {r["step"]: r for r in w.records}
    assert sorted(recs) == list(range(1, len(SCALED_STEPS) + 1)), [r["line"] for r in w.records]
    for k, what in enumerate(SCALED_STEPS, start=1):
        r = recs[k]
        if what == "overflow":
            assert r["verdict"] == "skipped" and "measured" not in r, (what, r["line"])
            assert "skipped this step (an overflow of the loss scale)" in r["why"], r["why"]
        elif what.endswith("early"):
            change = 0.5 if what == "grow early" else 2.0
            assert r["verdict"] == oracle.AFFECTED and r["matches"] == SCALE_GREW, (what, r["line"])
            assert r["loss_scale_change"] == change, (what, r.get("loss_scale_change"))
            assert r["measured"]["metrics"]["norm_ratio"] == pytest.approx(change, rel=1e-5), r["line"]
        else:
            assert r["verdict"] == oracle.NOT_AFFECTED, (k, what, r["line"])
            assert "loss_scale_change" not in r, (k, what, r["loss_scale_change"])


def test_a_records_held_bytes_count_its_sketches_and_inputs_and_a_short_window_is_said(tmp_path):
    """What a judged step held, as the record states it: the sketches (float64: 8 bytes a value, one row of the
    sketch's size per micro-batch) and the window's inputs (every argument's bytes); a window shorter than the GA the
    job declared is said; the engine's logged norm is judged once, for a judged step only."""
    from gradkit.watch.sketch import SIZE

    w = _job(tmp=tmp_path, steps=2, every=1, context={"declared_ga": 6})
    r = w.records[0]
    assert r["held_bytes"]["sketches"] == 4 * SIZE * 8
    assert r["held_bytes"]["inputs"] == (3 + 4 + 5 + 6) * 8 * 4  # each micro-batch's x: 3..6 rows of 8 fp32
    assert r["short_window"].startswith("the optimizer stepped after 4 of the 6 micro-batches")
    assert "short_window" not in _job(tmp=tmp_path / "b", steps=1, every=1, context={"declared_ga": 4}).records[0]
    assert w.judge_logged_norm(99, 1.0) is None  # not a judged step
    said = w.judge_logged_norm(2, 1.0)
    assert said["step"] == 2 and said["logged_norm"] == 1.0 and w.judge_logged_norm(2, 1.0) is None  # once
