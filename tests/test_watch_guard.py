"""The watch's fault guard (``gradkit.watch.guard``) in one process, no rank launched: its promises as its docstring
and docs/watch.md state them. An error of the watch's own, in any of its phases, ends that judged step as
``cannot-run`` with the fault's sentence and is never raised into the job, whose steps are those of the same job
without the watch; the next step is judged again; an error of the user's own code is never caught. The ranks agree on
a fault at fixed points of the step, before its next collective: a fault on rank 0 alone ends the step on every rank
with rank 0's sentence. The ranks are threads of this process meeting in a fake ``torch.distributed`` (``FakeDist``:
every collective the watch and the job make, in the order each rank makes them). The same promises on a real 2-rank
Trainer job are tests/test_watch_trainer_jobs.py's."""
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gradkit.watch.guard as guard
from gradkit.judge import oracle
from gradkit.watch import Watch
from tests.test_watch_judge import FakeWorld

PHASES = guard.PHASES  # capture, read, copy, reference, judgement, records, report: one judged step each
SIZES = [[3, 4, 5, 6], [2, 5, 4, 3]]  # each rank's micro-batches (samples), GA 4
N = sum(map(sum, SIZES))  # the global batch's samples: the loss is the mean over them


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


class UsersCriterion(nn.MSELoss):
    """The user's own criterion (the watch's pre-hook records its targets), raising its own error at ``fail_at``."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.fail_at, self.step = fail_at, 0

    def forward(self, out, y):
        if self.step == self.fail_at:
            raise ValueError(f"the user's own error at step {self.step}")
        return super().forward(out, y)


def _loop(model, steps, rank=0, world=1, tmp=None, user_error_at=None):
    """A data-parallel regression loop (AdamW, GA 4, the loss each micro-batch's mean weighted by its share of the
    global batch's samples, the gradients summed over the ranks by the job itself), watched where ``tmp`` is given;
    ``user_error_at``: the user's own criterion raises at that step. Returns the watch (or None) when done."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    crit = UsersCriterion(user_error_at)
    w = Watch(model, opt, criterion=crit, out=tmp, every=1, poll=0, log=None) if tmp else None
    sizes = SIZES[rank] if world > 1 else SIZES[0]
    total = N if world > 1 else sum(sizes)
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(1, steps + 1):
        for n in sizes:
            x, y = torch.randn(n, 8, generator=data), torch.randn(n, 2, generator=data)
            crit.step = step
            (crit(model(x), y) * n / total).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)  # the job's own DDP: summed over the ranks
        opt.step()
        opt.zero_grad()
    return w


class FakeDist(FakeWorld):
    """``w`` ranks as threads of this process behind ``torch.distributed``'s functions: ``get_rank`` is the calling
    thread's rank, and every collective (``all_reduce``, ``all_gather``) meets the other ranks' at a barrier
    (tests/test_watch_judge.py's world, its ``run`` the ranks' threads). Ranks
    that reach different collectives (a rank waiting in one the others never join) fail the test with both named,
    instead of hanging it."""

    def __init__(self, w: int, monkeypatch):
        super().__init__(w)
        for name, fn in {"is_available": lambda: True, "is_initialized": lambda: True,
                         "get_rank": lambda group=None: self.me.rank, "get_world_size": lambda group=None: self.w,
                         "get_backend": lambda group=None: "gloo", "all_reduce": self.all_reduce,
                         "all_gather": self.all_gather}.items():
            monkeypatch.setattr(dist, name, fn)

    def _meet(self, kind: str, t: torch.Tensor) -> list:
        self.slots[self.me.rank] = (kind, tuple(t.shape), t.detach().clone())
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        said = [(k, s) for k, s, _ in got]
        assert len(set(said)) == 1, f"the ranks are in different collectives: {said}"
        return [x for _, _, x in got]

    def all_reduce(self, t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        got = torch.stack(self._meet("all_reduce", t))
        t.copy_(got.amax(0) if op == dist.ReduceOp.MAX else got.amin(0) if op == dist.ReduceOp.MIN else got.sum(0))

    def all_gather(self, out, t, group=None, async_op=False):
        for o, x in zip(out, self._meet("all_gather", t)):
            o.copy_(x)


def test_a_fault_of_the_watch_in_each_phase_ends_its_step_as_cannot_run_and_the_job_goes_on_unchanged(
        tmp_path, monkeypatch):
    """The watch's first rule, phase by phase: a fault planted in each phase at its own step (guard.FAULT_ENV) is
    that step's ``cannot-run``, with the fault's own sentence, never raised into the loop; the step after them is
    judged again; the weights the job ends with are those of the same job without the watch."""
    steps = len(PHASES) + 1
    monkeypatch.setenv(guard.FAULT_ENV, ",".join(f"{ph}@{k}" for k, ph in enumerate(PHASES, start=1)))
    watched = _model()
    w = _loop(watched, steps, tmp=tmp_path / "faults")
    by_step = {r["step"]: r for r in w.records}
    assert sorted(by_step) == list(range(1, steps + 1)), [r["line"] for r in w.records]
    for k, phase in enumerate(PHASES, start=1):
        r = by_step[k]
        assert r["verdict"] == oracle.CANNOT_RUN, (phase, r["line"])
        assert f"a fault planted in the watch's {phase} at step {k}" in r["why"], (phase, r["why"])
        assert r["why"].startswith("the watch failed (") and r["why"].endswith("training went on"), r["why"]
        assert r["line"].startswith(f"gradkit watch: step {k}: cannot-run"), r["line"]
    assert by_step[steps]["verdict"] == oracle.NOT_AFFECTED, by_step[steps]["line"]  # judged again
    alone = _model()
    assert _loop(alone, steps) is None
    for (name, a), b in zip(watched.state_dict().items(), alone.state_dict().values()):
        assert torch.equal(a, b), f"{name}: the watched job's weights differ from the job's without the watch"
    monkeypatch.delenv(guard.FAULT_ENV)
    clean = _loop(_model(), 2, tmp=tmp_path / "clean")  # the control: the same loop without faults is judged
    assert [r["verdict"] for r in clean.records] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in clean.records]


def test_an_error_of_the_users_own_code_is_never_caught_by_the_watch(tmp_path):
    """The user's criterion raises in a judged step, right after the watch's own pre-hook on it ran: the error
    reaches the user's loop as it does without the watch (the watch judged the step before)."""
    with pytest.raises(ValueError, match="the user's own error at step 2"):
        _loop(_model(), 3, user_error_at=2)  # without the watch
    with pytest.raises(ValueError, match="the user's own error at step 2"):
        _loop(_model(), 3, tmp=tmp_path, user_error_at=2)
    rec = [json.loads(x) for x in (tmp_path / "watch.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec] == [1] and rec[0]["verdict"] == oracle.NOT_AFFECTED, rec


def test_the_ranks_agree_on_a_fault_of_one_rank_and_end_the_step_on_every_rank(tmp_path, monkeypatch):
    """A fault planted on rank 0 alone (guard.planted: rank 0 only) in its read at step 1, its copy at step 2 (before
    the step's first collective) and its judgement at step 3 (after the tally's sums, before the verdict): every rank
    ends each of those steps as ``cannot-run`` with rank 0's sentence, no rank is left in a collective the other
    never joins, and step 4 is judged again on both, not-affected (each rank's step is the global mean)."""
    planted = {1: "read", 2: "copy", 3: "judgement"}
    monkeypatch.setenv(guard.FAULT_ENV, ",".join(f"{ph}@{k}" for k, ph in planted.items()))
    world = FakeDist(2, monkeypatch)
    models = [_model(), _model()]  # built here: the ranks' threads share torch's seed
    watches = world.run(lambda r: _loop(models[r], 4, rank=r, world=2, tmp=tmp_path))
    for r, w in enumerate(watches):
        verdicts = {rec["step"]: rec for rec in w.records}
        assert sorted(verdicts) == [1, 2, 3, 4], (r, [rec["line"] for rec in w.records])
        for k, phase in planted.items():
            why = verdicts[k]["why"]
            assert verdicts[k]["verdict"] == oracle.CANNOT_RUN, (r, k, verdicts[k]["line"])
            assert f"rank 0's {phase}: RuntimeError: a fault planted in the watch's {phase} at step {k}" in why, \
                (r, k, why)
            assert "rank 1's" not in why, (r, k, why)  # rank 1 had no fault of its own: only rank 0 is said
        assert verdicts[4]["verdict"] == oracle.NOT_AFFECTED, (r, verdicts[4]["line"])
        assert verdicts[4]["world_size"] == 2 and verdicts[4]["per_rank"] == [4, 4], verdicts[4]
    a, b = watches[0].model.state_dict(), watches[1].model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "the ranks' replicas differ: the job itself was changed"


def test_faults_agree_says_every_ranks_fault_in_rank_order_and_nothing_where_none(monkeypatch):
    """``Faults.agree`` is a collective every rank calls at the same point: each rank gets the same sentence, every
    rank's first fault in rank order, '' where no rank has one; a rank's second fault does not replace its first."""
    world = FakeDist(3, monkeypatch)

    def rank(r):
        f = guard.Faults()
        said = [f.agree()]  # none anywhere
        if r != 1:
            f.run("read", 1, lambda: 1 / 0)
            f.run("judgement", 1, lambda: [][1])  # a second fault on the same rank: the first is kept
        said.append(f.agree())
        f.clear()
        said.append(f.agree())  # cleared: a new step
        return said

    got = world.run(rank)
    want = "rank 0's read: ZeroDivisionError: division by zero; rank 2's read: ZeroDivisionError: division by zero"
    assert got == [["", want, ""]] * 3, got


def test_a_faults_sentence_is_cut_at_400_characters_and_a_failed_steps_at_600():
    faults = guard.Faults()
    faults.note("read", RuntimeError("x" * 1000))
    assert faults.first == ("read: RuntimeError: " + "x" * 1000)[:400] and len(faults.first) == 400
    faults.note("copy", RuntimeError("a second fault"))  # the first is the step's
    assert faults.first.startswith("read: ")
    said = guard.failed("y" * 1000)
    assert said == ("the watch failed (" + "y" * 1000)[:600] and len(said) == 600
    assert guard.failed("short") == "the watch failed (short); training went on"
