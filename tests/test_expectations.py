"""The upstream table: pinned releases are asserted, newer ones are findings, B3 depends on the configuration."""
import pytest

from gradkit.judge import expectations as ex
from gradkit.stacks.versions import version_key


@pytest.mark.parametrize("bug, package, version, want", [
    ("B4", "deepspeed", "0.18.9", "affected"), ("B4", "deepspeed", "0.18.6", "affected"),
    ("B4", "deepspeed", "0.19.0", "not-affected"), ("B4", "deepspeed", "0.19.8", "not-affected"),
    ("B4", "deepspeed", "0.18.5", "affected"),  # its start, found by gradkit bisect (kit/judge/pins.py)
    ("B4", "deepspeed", "0.18.4", None),  # before it: another optimizer runs (B9), B4 is not pinned there
    ("B2", "deepspeed", "0.18.2", "affected"), ("B2", "deepspeed", "0.19.2", "affected"),
    ("B2", "deepspeed", "0.19.3", "not-affected"),
    ("B1", "transformers", "5.3.0", "affected"), ("B1", "transformers", "5.23.0", "not-affected"),
    ("B1", "transformers", "5.9.0", "affected"), ("B1", "transformers", "5.10.1", "not-affected"),  # the fix, pinned
    ("B4", "deepspeed", "0.20.1", None), ("B2", "deepspeed", "0.19.9+cpu", None),  # newer than the table
])
def test_expected_verdict_per_release(bug, package, version, want):
    assert ex.expected(bug, {package: version}) == want


def test_b3_depends_on_the_stage_and_the_fix():
    v = {"deepspeed": "0.19.3"}
    assert [ex.expected("B3", v, "manual", s) for s in (0, 1, 2, 3)] == ["not-affected", "affected", "affected", "not-affected"]
    assert ex.expected("B3", v, "fix_unmanaged", 2) == "affected"  # the key arrives in 0.19.4
    assert ex.expected("B3", {"deepspeed": "0.19.4"}, "fix_unmanaged", 2) == "not-affected"
    assert ex.expected("B3", v, "fix_boundary", 1) == "not-affected"


def test_a_pinned_mismatch_fails_a_newer_release_is_a_finding():
    word, text = ex.judge_release("B4", {"deepspeed": "0.19.8"}, "affected")
    assert word == "mismatch" and "harness is suspect" in text
    word, text = ex.judge_release("B4", {"deepspeed": "0.20.1"}, "not-affected")
    assert word == "finding" and "0.20.1" in text and "is not affected" in text
    word, text = ex.judge_release("B4", {"deepspeed": "0.20.1"}, "affected")
    assert word == "finding" and "still affected" in text
    assert ex.judge_release("B4", {"deepspeed": "0.18.9"}, "cannot-run")[0] == "not-judged"
    assert ex.judge_release("B4", {"deepspeed": "0.18.9"}, "affected")[0] == "ok"


def test_mismatches_over_records():
    recs = [{"verdict": "affected", "versions": {"deepspeed": "0.18.9"}, "role": "measured"},
            {"verdict": "affected", "versions": {"deepspeed": "0.19.8"}, "role": "measured"},
            {"verdict": "not-affected", "versions": {"deepspeed": "0.21.0"}, "role": "measured"},
            {"verdict": "affected", "versions": {"deepspeed": "0.19.8"}, "role": "control"}]
    bad, found = ex.mismatches("B4", recs, role="measured")
    assert len(bad) == 1 and "0.19.8" in bad[0]
    assert len(found) == 1 and "0.21.0" in found[0]


def test_versions_order_numerically():
    assert version_key("0.19.10") > version_key("0.19.9") > version_key("0.19.8+cpu") == (0, 19, 8)
