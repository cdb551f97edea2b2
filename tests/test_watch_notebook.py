"""Notebook 09's own checks (``gradkit.notebooks.watch.problems``) on records made by hand: a step is affected where its
applied step or its logged grad norm is, not-affected where both are."""
from gradkit.judge import oracle
from gradkit.notebooks import watch

A, N = oracle.AFFECTED, oracle.NOT_AFFECTED


def _res(expect, *steps):
    """One job's result: per step, the applied step's verdict and the logged norm's (None: none logged)."""
    recs = []
    for k, (applied, logged) in enumerate(steps, start=1):
        recs.append({"step": k, "verdict": applied, "line": f"step {k}: {applied}"})
        if logged:
            recs.append({"step": k, "verdict": logged, "logged_norm": 1.0, "line": f"step {k} norm: {logged}"})
    return {"records": recs, "rc": 0, "tail": "", "job": {"expect": expect}}


def test_a_planted_defect_clipped_right_is_still_affected_by_its_logged_norm():
    assert watch.problems({"no /N": _res(A, (A, A), (N, A))}) == []
    said = watch.problems({"no /N": _res(A, (A, A), (N, N))})
    assert said == ["no /N: step 2 is not-affected; its logged norm not-affected, expected affected: step 2: "
                    "not-affected"]


def test_a_right_job_must_be_right_on_both_verdicts():
    assert watch.problems({"ok": _res(N, (N, N), (N, None))}) == []
    assert watch.problems({"ok": _res(N, (N, A))})[0].startswith("ok: step 1 is not-affected; its logged norm affected")
    assert watch.problems({"ok": _res(N, (oracle.INCONCLUSIVE, None))})[0].startswith("ok: step 1 is inconclusive")


def test_a_job_that_failed_or_judged_nothing_is_said():
    bad = _res(N, (N, None))
    bad["rc"] = 1
    assert watch.problems({"j": bad})[0].startswith("j: the job failed (exit 1)")
    assert watch.problems({"j": {"records": [], "rc": 0, "tail": "", "job": {"expect": N}}})[0].startswith("j: the job")


def test_an_affected_step_must_be_named_by_the_expected_bug_not_merely_mention_it():
    def job(known):
        res = _res({"bug": "B5"}, (A, None))
        res["records"][0].update(versions={"deepspeed": "0.16.9"}, known=known)
        return {"B5 job": res}

    assert watch.problems(job("B5 (deepspeedai/DeepSpeed#7967): ...; the step is 'first and last micro-batch'")) == []
    said = watch.problems(job("not explained by any known bug: B5, B7 is expected here, but the step is 'none'"))
    assert said and said[0].startswith("B5 job: step 1 is affected but not named B5")
    tie = f"{watch.TIE}: B1 (x) is expected on transformers 4.46.3: ...; B5 (y) is expected ..."
    assert watch.problems(job(tie)) == []  # a tie the watch says, the expected bug among it
