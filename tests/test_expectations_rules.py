"""The upstream table's arithmetic, on stated releases: versions, rules and their smallest GA, the fix's words,
findings on releases newer than the table, and the mismatches a notebook asserts empty."""
import pytest

from gradkit.judge import expectations as ex
from gradkit.judge import oracle
from gradkit.stacks.versions import version_key


@pytest.mark.parametrize("version, key", [("0.19.8", (0, 19, 8)), ("0.19.8+cpu", (0, 19, 8)), ("1.2rc1", (1, 2)),
                                          ("10.0.1", (10, 0, 1)), ("2.13.0+cu126", (2, 13, 0)), ("x.1", (0, 1))])
def test_a_version_is_read_by_its_leading_numbers(version, key):
    assert version_key(version) == key


def test_a_rule_with_a_smallest_ga_holds_from_that_ga_on():
    for bug, package, release in (("FSDP2", "torch", "2.13.0"), ("ACC", "accelerate", "1.15.0"),
                                  ("HFT", "transformers", "5.23.0")):
        assert ex.expected(bug, {package: release}, case="sum_not_mean", ga=2) == oracle.AFFECTED, bug
        assert ex.expected(bug, {package: release}, case="sum_not_mean", ga=8) == oracle.AFFECTED, bug
    assert ex.expected("ACC", {"accelerate": "1.15.0"}, case="sum_not_mean", ga=1) == oracle.NOT_AFFECTED
    assert ex.expected("HFT", {"transformers": "5.23.0"}, case="sum_not_mean", ga=1) is None  # never run at GAS 1
    assert ex.expected("ACC", {"accelerate": "0.30.1"}, case="sync_each_batch", ga=2) == oracle.AFFECTED
    assert ex.expected("ACC", {"accelerate": "0.28.0"}, case="sync_each_batch", ga=1) == oracle.NOT_AFFECTED
    assert ex.expected("ACC", {"accelerate": "0.27.2"}, case="sync_each_batch", ga=4) is None  # before it existed


def test_b3_depends_on_the_stage_and_the_opt_out_on_the_release():
    assert ex.expected("B3", {"deepspeed": "0.19.3"}, case="manual", zero_stage=2) == oracle.AFFECTED
    assert ex.expected("B3", {"deepspeed": "0.19.3"}, case="manual", zero_stage=3) == oracle.NOT_AFFECTED
    assert ex.expected("B3", {"deepspeed": "0.19.3"}, case="fix_unmanaged", zero_stage=2) == oracle.AFFECTED
    assert ex.expected("B3", {"deepspeed": "0.19.3"}, case="fix_unmanaged", zero_stage=0) == oracle.NOT_AFFECTED
    assert ex.expected("B3", {"deepspeed": "0.19.3"}, case="fix_unmanaged", zero_stage=3) == oracle.NOT_AFFECTED
    assert ex.expected("B3", {"deepspeed": "0.19.4"}, case="fix_unmanaged", zero_stage=2) == oracle.NOT_AFFECTED


def test_the_fix_is_said_with_its_pull_requests_or_as_absent():
    assert ex.KNOWN["B4"].fix_text() == "fixed in deepspeed 0.19.0 (deepspeedai/DeepSpeed#7985)"
    assert ex.KNOWN["B6"].fix_text() == "no release fixes it"


def test_a_release_newer_than_the_table_is_a_finding_that_says_what_changed():
    word, text = ex.judge_release("B4", {"deepspeed": "0.20.1"}, oracle.NOT_AFFECTED)
    assert word == "finding" and "is not affected (as the fix implies)" in text
    word, text = ex.judge_release("B4", {"deepspeed": "0.20.1"}, oracle.AFFECTED)
    assert word == "finding" and "is still affected, although the fix landed in 0.19.0" in text
    word, text = ex.judge_release("B6", {"deepspeed": "0.20.1"}, oracle.NOT_AFFECTED)
    assert word == "finding" and ": a finding, no fix is known" in text
    word, text = ex.judge_release("HFT", {"transformers": "5.23.0"}, oracle.NOT_AFFECTED, case="a case of no rule")
    assert word == "finding" and "not pinned" in text  # the table's newest release, not a newer one
    assert ex.judge_release("B4", {"deepspeed": "0.19.0"}, oracle.CANNOT_RUN)[0] == "not-judged"


def test_mismatches_look_at_every_matching_record_and_the_verdict_asked_for():
    other = {"case": "manual", "zero_stage": 2, "versions": {"deepspeed": "0.19.3"}, "verdict": oracle.AFFECTED,
             "dtype": "bf16"}
    wrong = {**other, "dtype": "fp32", "verdict": oracle.NOT_AFFECTED}
    bad, _ = ex.mismatches("B3", [other, wrong], dtype="fp32")  # the first is not selected: the second is still seen
    assert len(bad) == 1 and "measured not-affected, but upstream says affected" in bad[0]
    by_config = {**wrong, "config_verdict": oracle.AFFECTED}
    assert ex.mismatches("B3", [by_config], verdict_key="config_verdict")[0] == []
    assert len(ex.mismatches("B3", [by_config])[0]) == 1  # the record's own verdict
