"""The watch in an Accelerate loop in one process (``gradkit.watch.accelerate``): Accelerate's own accumulation
(``accelerator.accumulate``, its backward dividing by GA) judged exact at every step, the records carrying what the
user declared (GA, ``sync_each_batch``) and the releases, and the engine's adapter taking over under Accelerate's
DeepSpeed plugin. The plugin on a real 2-rank DeepSpeed job: test_watch_trainer_jobs.py."""
import types

import accelerate
import pytest
import torch
import torch.nn as nn
from accelerate.utils import GradientAccumulationPlugin

from gradkit.judge import oracle
from gradkit.watch import accelerate as watch_acc


@pytest.mark.parametrize("sync_each_batch,summed", [(False, False), (True, False), (False, True)])
def test_accelerates_own_accumulation_is_exact_and_each_record_says_what_the_user_declared(tmp_path, sync_each_batch,
                                                                                           summed):
    """``summed``: the user's loop calls ``loss.backward()`` (no division by GA): affected, and the record asks the
    bug table about Accelerate's release."""
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=4, sync_each_batch=sync_each_batch))
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    crit = nn.MSELoss()
    w = watch_acc.watch_accelerate(acc, model, opt, criterion=crit, out=str(tmp_path), log=None, every=1,
                                   context={"job": "mine"})
    data = torch.Generator().manual_seed(1)
    for _ in range(2):
        for _ in range(4):
            with acc.accumulate(model):
                x, y = torch.randn(3, 8, generator=data), torch.randn(3, 2, generator=data)
                loss = crit(model(x), y)
                loss.backward() if summed else acc.backward(loss)
                opt.step()
                opt.zero_grad()
    want = oracle.AFFECTED if summed else oracle.NOT_AFFECTED
    assert [r["verdict"] for r in w.records] == [want] * 2, [r["line"] for r in w.records]
    for r in w.records:
        assert r["ga"] == 4 and r["declared_ga"] == 4 and r["sync_each_batch"] is sync_each_batch
        assert r["versions"]["accelerate"] == accelerate.__version__ and r["versions"]["torch"] == torch.__version__
        assert r["job"] == "mine"
        assert ("not explained by a known bug: ACC not expected on accelerate " in r["line"]) is summed, r["line"]


def test_under_accelerates_deepspeed_plugin_the_engines_adapter_takes_the_watch(monkeypatch):
    handed = []
    engine = types.SimpleNamespace(gradkit_watch="the engine's watch")
    monkeypatch.setattr(watch_acc, "watch_engine", lambda model, **kw: handed.append((model, kw)) or engine)
    accelerator = types.SimpleNamespace(distributed_type="DistributedType.DEEPSPEED")
    assert watch_acc.watch_accelerate(accelerator, "engine", None, every=2) == "the engine's watch"
    assert handed == [("engine", {"every": 2})]
