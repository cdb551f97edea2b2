"""Which known bug the watch names for an affected step of a Trainer or Accelerate job (``gradkit.watch.known``), on
records made by hand: the bug table's ranges (B1 and HFT fixed in transformers 5.10.1, B1 from 4.46.3; ACC's
sync_each_batch fixed in accelerate 0.31.0; B9 from DeepSpeed 0.18.3; B10 in every release), a tie said as a tie,
and B9's and B10's own named steps under the Trainer on DeepSpeed. The same code runs inside a watched job's rank (the
world tests of test_watch_trainer_jobs.py); here in a second."""
from gradkit.judge import expectations, naming
from gradkit.stacks import fixes
from gradkit.watch import known


def test_a_jobs_case_in_the_bug_table_is_the_trainers_loop_or_accelerates_plugin_setting():
    assert known.case_of("HFT", {}) == "trainer"
    assert known.case_of("ACC", {"sync_each_batch": True}) == "sync_each_batch"
    assert known.case_of("ACC", {"sync_each_batch": False}) == known.case_of("ACC", {}) == "accumulate"
    assert known.case_of("B1", {"sync_each_batch": True}) is None


def _said(bug: str, version: str) -> str:
    k = expectations.KNOWN[bug]
    return f"{bug} ({k.report}) is expected on {k.package} {version}: {k.fix_text()}"


def test_each_bug_the_table_expects_on_the_jobs_releases_is_said_and_two_are_a_tie_never_one_of_them():
    def trainer(v, **kw):
        return known.from_table({"versions": {"transformers": v}, "matches": "none", **kw}, "trainer")

    def acc(v, sync):
        return known.from_table({"versions": {"accelerate": v}, "sync_each_batch": sync}, "accelerate")

    assert trainer("4.45.2", declared_ga=4) == _said("HFT", "4.45.2")  # before B1's first release: HFT alone
    assert trainer("4.46.3", trainer_ga=4) == known.TIE + ": " + _said("B1", "4.46.3") + "; " + _said("HFT", "4.46.3")
    assert trainer("5.10.1") == ("not explained by a known bug: B1, HFT not expected on transformers 5.10.1, "
                                 "transformers 5.10.1 (the step is 'none'); look at your own loss, collator and loop")
    assert acc("0.30.1", True) == _said("ACC", "0.30.1")
    # ACC's sync_each_batch needs GA >= 2 (the table's rule): the GA the job declared, else the Trainer's
    for rec in ({"declared_ga": 1}, {"trainer_ga": 1}):
        one = known.from_table({"versions": {"accelerate": "0.30.1"}, "sync_each_batch": True, **rec}, "accelerate")
        assert one.startswith("not explained by a known bug: ACC not expected on accelerate 0.30.1"), rec
    assert known.from_table({"versions": {"accelerate": "0.30.1"}, "sync_each_batch": True, "declared_ga": 4,
                             "trainer_ga": 1}, "accelerate") == _said("ACC", "0.30.1")
    assert acc("0.30.1", False).startswith("not explained by a known bug: ACC not expected on accelerate 0.30.1")
    assert acc("0.31.0", True).startswith("not explained by a known bug: ACC not expected on accelerate 0.31.0")
    assert known.from_table({"versions": {}}, "accelerate").startswith("not explained by a known bug: ACC not "
                                                                      "expected on accelerate ?")


def test_b9s_and_b10s_own_steps_are_named_where_the_table_expects_them_before_any_other_bug():
    def named(step, ds):
        return known.named_step({"versions": {"deepspeed": ds, "transformers": "4.46.3"}, "matches": step})

    for bug, step in (("B10", naming.SCALE_GREW), ("B9", naming.UNSCALED)):
        k = expectations.KNOWN[bug]
        said = named(step, "0.19.8")
        assert said.startswith(f"{bug} ({k.report}): {k.explains[0]}; fix: {k.explains[2]}")
        patch = fixes.verified_report(bug)
        assert (f"; a patch the kit verified: {patch}" in said) == bool(patch)
        rec = {"versions": {"deepspeed": "0.19.8", "transformers": "4.46.3"}, "matches": step}
        assert known.from_table(rec, "trainer") == said  # not B1 / HFT, which the releases also expect
    assert named(naming.UNSCALED, "0.18.2") is None  # B9 came with 0.18.3
    assert named(naming.SCALE_GREW, "0.18.2").startswith("B10 (")
    assert named("global mean", "0.19.8") is None and named(None, "0.19.8") is None
