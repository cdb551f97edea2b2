"""B1 on real Trainer steps (tiny Qwen3, W = 2 as scripts/run_all.sh runs it): which path does GAS change,
does any match the reference, on the report's versions and the installed ones."""
import pytest

from gradkit import config as kconfig
from gradkit.judge import expectations, oracle, records
from gradkit.probes import trainer_ga as tg
from gradkit.probes.ranks.judging import STEPS

pytestmark = pytest.mark.usefixtures("warm_module")  # one import per stack for the module's runs

SEED_STACK = {"transformers": "5.3.0", "deepspeed": "0.18.9"}  # the report's versions
GAS = 4
W = 2


@pytest.fixture(scope="module")
def recs():
    return tg.run(stacks=(SEED_STACK, {}), paths=("no_ds", "ds_zero0"), gas_values=(1, GAS),
                  cases=("trainer", "accepts_false"), world_size=W, timeout_s=600)


@pytest.mark.world
def test_every_step_ran_with_a_loss_kwargs_model(recs):
    assert len(recs) == 2 * (2 + 2 * 3)  # per stack: a harness per GAS; per path gas1, trainer, accepts_false
    for r in recs:
        records.check(r)
        assert r["verdict"] != oracle.CANNOT_RUN, r["reason"]
        assert r["world_size"] == W
        if r["case"] in ("trainer", "gas1"):
            assert r["model_accepts_loss_kwargs"] is True


@pytest.mark.world
def test_the_control_is_the_plain_pytorch_harness_and_matches_on_every_stack(recs):
    """transformers 5.3.0 moves its own GAS = 1 step off the reference; the harness does not depend on it."""
    for r in records.select(recs, case="harness"):
        assert r["role"] == "control" and r["verdict"] == oracle.NOT_AFFECTED, r["reason"]
    label = tg.stack_label(SEED_STACK)
    for path in ("no_ds", "ds_zero0"):
        gas1 = records.one(recs, version=label, case="gas1", path=path)
        assert gas1["verdict"] == oracle.AFFECTED, gas1["reason"]  # was 'inconclusive' with the Trainer as control
        assert gas1["token_factor"] < 1 and gas1["gas_factor"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.world
def test_report_versions_no_deepspeed_path_divides_by_gas_twice(recs):
    label = tg.stack_label(SEED_STACK)
    no_ds = records.one(recs, version=label, case="trainer", path="no_ds")
    ds = records.one(recs, version=label, case="trainer", path="ds_zero0")
    assert no_ds["gas_verdict"] == oracle.AFFECTED and no_ds["ratio_vs_control"] == pytest.approx(1 / GAS, rel=1e-4)
    assert ds["gas_verdict"] == oracle.NOT_AFFECTED  # DeepSpeed does not sum: GAS leaves its step unchanged
    # ... yet neither matches the reference: the token count, computed over both ranks, explains the rest exactly
    for r in (no_ds, ds):
        assert r["verdict"] == oracle.AFFECTED, r["reason"]
        assert r["token_factor"] < 1 and r["gas_factor"] == pytest.approx(GAS ** round(r["gas_power"]), rel=1e-5)
    assert round(no_ds["gas_power"]) == -1 and round(ds["gas_power"]) == 0
    for r in (no_ds, ds):  # every step, each on its own global batch from its own weights, is the same story
        assert len(r["steps"]) == STEPS and sorted(i for st in r["steps"] for i in st["rows"]) == list(range(8 * W * STEPS))
        assert all(len(st["rows"]) == 8 * W for st in r["steps"])
        for st in r["steps"]:
            assert st["gas_factor"] == pytest.approx(GAS ** round(r["gas_power"]), rel=1e-5)
        assert [st["gas_verdict"] for st in no_ds["steps"]] == [oracle.AFFECTED] * STEPS
    assert [t["kwargs"].get("scale_wrt_gas") for t in ds["trace"] if t["call"] == "accelerator.backward"] == [False] * GAS
    assert tg.violations(recs) == []
    assert expectations.mismatches("B1", recs, case="trainer") == ([], [])
    # the seed's observation, grad norm with DS / without DS = GAS, holds, with the blame reversed
    # (the first step: both start from the same weights on the same rows; later steps start where each went)
    first = [r["steps"][0]["metrics"]["effective_norm"] for r in (ds, no_ds)]
    assert first[0] / first[1] == pytest.approx(GAS, rel=1e-4)


@pytest.mark.world
def test_installed_versions_match_the_reference_on_every_path(recs):
    for path in ("no_ds", "ds_zero0"):
        r = records.one(recs, version="installed", case="trainer", path=path)
        assert r["verdict"] == oracle.NOT_AFFECTED and r["gas_verdict"] == oracle.NOT_AFFECTED, r["reason"]
        assert r["token_factor"] == pytest.approx(1.0)  # num_items_in_batch = the label tokens really summed


def test_bad_b1_parameters_fail_before_any_launch():
    with pytest.raises(kconfig.ConfigError, match="unknown B1 path"):
        tg.run(paths=("ds_zero5",))
    with pytest.raises(kconfig.ConfigError, match="does not divide"):
        tg.run(gas_values=(1, 3))
    with pytest.raises(kconfig.ConfigError, match="stacks pin"):
        tg.run(stacks=({"torch": "2.0"},))
