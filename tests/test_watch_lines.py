"""What the watch writes of a judged step (``gradkit.watch.lines``), on records made by hand: the log line of each
verdict (a not-affected step says its numbers only, a cannot-run or inconclusive one its reason, an affected one its
step and known bug), a record's values made JSON-safe (NaN as null, dicts and tuples all the way down), the bytes of
a micro-batch's arguments, and an earlier run's records moved aside, never overwritten."""
import json
import math
import os

import torch

from gradkit.judge import oracle
from gradkit.watch import lines


def _rec(verdict, **kw):
    return {"step": 3, "verdict": verdict, "why": "its reason", "ga": 4, "world_size": 2, "loss": "mean over samples",
            "global_count": 36, "measured": {"metrics": {"norm_ratio": 1.0, "cosine": 1.0, "rel_l2": 0.0},
                                             "attribution": {"misplaced_weight": 0.5}}, **kw}


def test_each_verdicts_line_says_what_a_reader_needs_of_it():
    numbers = ("gradkit watch: step 3: {} (ratio 1.0000, cosine 1.00000, rel. error 0.00e+00, misplaced weight "
               "5.00e-01; 4 micro-batches x 2 ranks, mean over samples over 36)")
    assert lines.line(_rec(oracle.NOT_AFFECTED)) == numbers.format(oracle.NOT_AFFECTED)
    assert lines.line(_rec(oracle.CANNOT_RUN)) == numbers.format(oracle.CANNOT_RUN) + "; its reason"
    assert lines.line(_rec(oracle.AFFECTED, matches="sum", shape="x4", known="B3")) == \
        numbers.format(oracle.AFFECTED) + "; the step is 'sum': x4; B3"
    free = lines.line(_rec(oracle.NOT_AFFECTED, why="... not identifiable ..."))
    assert free.endswith("; the fitted weights are not identifiable on these micro-batches (alike ones)")
    assert "misplaced weight nan" in lines.line(_rec(oracle.NOT_AFFECTED, measured={"metrics": {
        "norm_ratio": 1.0, "cosine": 1.0, "rel_l2": 0.0}}))  # no attribution: said as unknown
    assert lines.line({"step": 2, "verdict": "skipped", "why": "the scaler skipped it"}) == \
        "gradkit watch: step 2: skipped (the scaler skipped it)"


def test_a_record_is_made_json_safe_all_the_way_down_and_its_inputs_counted_in_bytes():
    got = lines.plain({"a": (torch.tensor([1.0, 2.0]), [float("nan"), 3]), "b": {"c": float("nan")}, "d": "s"})
    assert got == {"a": [[1.0, 2.0], [None, 3]], "b": {"c": None}, "d": "s"}
    json.dumps(got, allow_nan=False)
    assert lines.plain(math.inf) == math.inf and lines.plain(2) == 2
    x = torch.zeros(3, 4)
    assert lines.nbytes({"x": x, "pair": (x.half(), [x]), "n": 7, "s": "text"}) == 48 + 24 + 48
    assert lines.nbytes(5) == 0


def test_an_earlier_runs_records_are_moved_aside_never_overwritten(tmp_path):
    path = tmp_path / "watch.jsonl"
    assert lines.keep_earlier(path) is None  # none yet
    path.write_text("")
    assert lines.keep_earlier(path) is None and path.exists()  # empty: nothing to keep
    kept = []
    for i in range(3):
        path.write_text(f"run {i}\n")
        os.utime(path, (1_700_000_000, 1_700_000_000))  # the same second each time
        kept.append(lines.keep_earlier(path))
    stamp = kept[0].stem.split("-", 1)[1]
    assert [k.name for k in kept] == [f"watch-{stamp}.jsonl", f"watch-{stamp}-2.jsonl", f"watch-{stamp}-3.jsonl"]
    assert [k.read_text() for k in kept] == ["run 0\n", "run 1\n", "run 2\n"] and not path.exists()
