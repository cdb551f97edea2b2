"""The test map's answers (scripts/testmap.py), on a small map made here: which tests a mutant's statement or a changed
function needs. The mutation run (scripts/mutation_run.py) and `bash scripts/test.sh --changed` stand on them: a
selection that misses a test that reaches the code lets a wrong instrument pass."""
import importlib

import testmap

SOURCE = '''import os

LIMIT = 3


def f(x):
    if x > LIMIT:
        return (x +
                1)
    return x


class C:
    def g(self):
        return f(
            2)
'''


def _map(source=SOURCE):
    """A map as `from_coverage` writes it: tests a and b ran f's first lines, only b its branch, c the class."""
    ids = ["tests/test_a.py::test_a", "tests/test_b.py::test_b", "tests/test_c.py::test_c", "tests/test_d.py::"]
    by_line = {"1": [3], "3": [3], "6": [3], "7": [0, 1], "8": [1], "10": [0], "13": [3], "14": [3], "15": [2]}
    functions = {"<module>": ["tests/test_d.py::"], "f": ids[:3], "C.g": [ids[2]]}
    return {"functions": {"kit/m.py": functions}, "ids": ids,
            "lines": {"kit/m.py": {"sha": testmap.digest(source), "by_line": by_line}}}


def test_a_statement_is_the_innermost_one_holding_the_line_and_a_header_takes_its_whole_statement():
    assert testmap.statement(SOURCE, 8) == (8, 9) and testmap.statement(SOURCE, 9) == (8, 9)  # one return, two lines
    assert testmap.statement(SOURCE, 7) == (7, 9)  # the if's header: the if with its body
    assert testmap.statement(SOURCE, 3) == (3, 3)
    assert testmap.statement(SOURCE, 4) is None  # a blank line between statements


def test_a_mutants_line_takes_the_tests_that_ran_its_statement_only():
    m = _map()
    assert testmap.tests_of_line(m, "kit/m.py", SOURCE, 8) == {"tests/test_b.py::test_b"}  # the branch: b alone
    assert testmap.tests_of_line(m, "kit/m.py", SOURCE, 9) == {"tests/test_b.py::test_b"}  # recorded on line 8
    assert testmap.tests_of_line(m, "kit/m.py", SOURCE, 10) == {"tests/test_a.py::test_a"}
    assert testmap.tests_of_line(m, "kit/m.py", SOURCE, 7) == {"tests/test_a.py::test_a", "tests/test_b.py::test_b"}
    assert testmap.tests_of_line(m, "kit/m.py", SOURCE, 16) == {"tests/test_c.py::test_c"}  # f(\n 2): line 15's


def test_the_lines_are_not_trusted_for_another_text_or_a_statement_nothing_recorded():
    m = _map()
    edited = SOURCE.replace("LIMIT = 3", "LIMIT = 4")  # the mutant's own module is the measured one but for the
    assert testmap.tests_of_line(m, "kit/m.py", edited, 8) is None  # mutant; any other edit: the function's tests
    assert testmap.tests_of_line(m, "kit/other.py", SOURCE, 8) is None
    del m["lines"]["kit/m.py"]["by_line"]["8"]
    assert testmap.tests_of_line(m, "kit/m.py", SOURCE, 8) is None  # then its function answers, conservatively
    assert testmap.tests_of(m, "kit/m.py", {"f"}) == set(m["ids"][:3])


def test_a_function_takes_its_tests_and_an_unknown_one_or_the_top_level_takes_the_modules_every_test():
    m = _map()
    every = set(m["ids"])
    assert testmap.tests_of(m, "kit/m.py", {"C.g"}) == {"tests/test_c.py::test_c"}
    assert testmap.tests_of(m, "kit/m.py", {"C.g.inner"}) == {"tests/test_c.py::test_c"}  # its nearest known scope
    assert testmap.tests_of(m, "kit/m.py", {"h"}) == every
    assert testmap.tests_of(m, "kit/m.py", {"<module>"}) == every


def test_a_mutants_stages_split_its_tests_by_world_and_run_a_world_stage_of_several_files_on_two_workers_cheapest_first():
    mutation_run = importlib.import_module("mutation_run")
    m = {**_map(), "world_tests": ["tests/test_b.py::test_b", "tests/test_c.py::test_c"]}
    where = testmap.functions(SOURCE)
    fast, world = mutation_run.stages(m, "kit/m.py", 7, where, set(), SOURCE)
    assert fast == ["tests/test_a.py::test_a", "-m", "not world"]
    assert world == ["tests/test_b.py::test_b", "-m", "world"]  # one file: one worker
    fast, world = mutation_run.stages(m, "kit/m.py", 7, where, set(), SOURCE.replace("3", "4"))  # function's tests
    assert fast == ["tests/test_a.py::test_a", "-m", "not world"]
    assert world == ["tests/test_b.py::test_b", "tests/test_c.py::test_c", "-m", "world", "-n", "2", "--dist",
                     "loadfile"]
    assert mutation_run.stages(m, "kit/m.py", 8, where, {"tests/test_e.py::"}, SOURCE) == (
        ["tests/test_e.py", "-m", "not world"], ["tests/test_b.py::test_b", "-m", "world"])  # a newer file: whole
    m["durations"] = {"tests/test_b.py::test_b": 30.0, "tests/test_c.py::test_c": 4.0}
    fast, world = mutation_run.stages(m, "kit/m.py", 7, where, set(), SOURCE.replace("3", "4"))
    assert world[:2] == ["tests/test_c.py::test_c", "tests/test_b.py::test_b"]  # the cheapest world test first
    m["durations"].update({"tests/test_a.py::test_a": 5.0, "tests/test_e.py::test_x": 1.0})
    fast, _ = mutation_run.stages(m, "kit/m.py", 7, where, {"tests/test_e.py::"}, SOURCE)
    assert fast == ["tests/test_e.py", "tests/test_a.py::test_a", "-m", "not world"]  # the fast stage too


def test_a_top_level_value_takes_the_tests_that_ran_a_statement_reading_it_followed_through_values_made_from_it(tmp_path):
    """A mutant of ``LIMIT = 3`` changes the program only where LIMIT is read: in its module (f's branch), in another
    module that imports it (and a value computed from it there), and in a test that reads it itself. Not the
    tests that merely imported the module (coverage credits its top level to them)."""
    readers = importlib.import_module("testmap_readers")
    (tmp_path / "kit").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "kit" / "m.py").write_text(SOURCE + "\nA, B = 1, 2\n")
    other = ("from gradkit.m import LIMIT\n\nDOUBLE = LIMIT * 2\n\n\ndef h():\n    return DOUBLE\n\n\n"
             "def k():\n    return 0\n")
    (tmp_path / "kit" / "n.py").write_text(other)
    (tmp_path / "kit" / "p.py").write_text("from gradkit import other as m\n\n\ndef q():\n    return m.LIMIT\n")
    (tmp_path / "tests" / "test_e.py").write_text(
        "from gradkit import m\n\n\ndef test_e():\n    assert m.LIMIT == 3\n\n\ndef test_f():\n    pass\n")
    m = _map()
    m["ids"].append("tests/test_n.py::test_h")
    m["lines"]["kit/n.py"] = {"sha": testmap.digest(other), "by_line": {"1": [3], "3": [3], "7": [4]}}
    m["functions"]["kit/n.py"] = {"h": ["tests/test_n.py::test_h"]}
    got = readers.tests_of_readers(m, "kit/m.py", SOURCE, 3, repo=tmp_path)
    # f's `if x > LIMIT` (a and b), h's DOUBLE (n.py's test), test_e; not test_d (the import), not p.py's other.LIMIT
    assert got == {"tests/test_a.py::test_a", "tests/test_b.py::test_b", "tests/test_n.py::test_h",
                   "tests/test_e.py::test_e"}
    assert readers.bound_names(SOURCE + "\nA, B = 1, 2\n", 18, 10) == ({"B"}, False)  # the tuple's element mutated
    assert readers.bound_names(SOURCE, 13) == ({"C"}, False)  # a class's header: where the class is used
    assert readers.bound_names("@deco\nclass D:\n    x = 1\n", 1) == ({"D"}, False)  # its decorator too
    assert readers.tests_of_readers(m, "kit/m.py", SOURCE, 1, repo=tmp_path) is None  # an import: the map answers
    assert readers.tests_of_readers(m, "kit/m.py", SOURCE, 8, repo=tmp_path) is None  # a function's body


def test_test_files_measured_again_replace_what_the_map_said_of_them_and_keep_the_rest():
    build = importlib.import_module("testmap_build")
    old = _map()  # b ran lines 7, 8 and f; a ran 7, 10
    b2 = "tests/test_b.py::test_b2"
    new = {"functions": {"kit/m.py": {"C.g": [b2]}, "kit/n.py": {"h": [b2]}},
           "ids": ["tests/test_b.py::test_b2"],
           "lines": {"kit/m.py": {"sha": testmap.digest(SOURCE), "by_line": {"15": [0]}},
                     "kit/n.py": {"sha": "n", "by_line": {"2": [0]}}}}
    got = build.merge(old, new, ["tests/test_b.py"])
    assert "tests/test_b.py::test_b" not in got["ids"] and "tests/test_b.py::test_b2" in got["ids"]
    assert got["functions"]["kit/m.py"]["f"] == ["tests/test_a.py::test_a", "tests/test_c.py::test_c"]
    assert got["functions"]["kit/m.py"]["C.g"] == ["tests/test_b.py::test_b2", "tests/test_c.py::test_c"]
    assert testmap.tests_of_line(got, "kit/m.py", SOURCE, 8) is None  # only b ran it: nothing recorded now
    assert testmap.tests_of_line(got, "kit/m.py", SOURCE, 7) == {"tests/test_a.py::test_a"}
    assert testmap.tests_of_line(got, "kit/m.py", SOURCE, 15) == {"tests/test_c.py::test_c", "tests/test_b.py::test_b2"}
    assert got["functions"]["kit/n.py"] == {"h": ["tests/test_b.py::test_b2"]} and "kit/n.py" in got["lines"]
    changed = {**new, "lines": {"kit/m.py": {"sha": "another text", "by_line": {}}}}
    assert "kit/m.py" not in build.merge(old, changed, ["tests/test_b.py"])["lines"]  # its functions answer
    assert got["merged"] == {}  # a file that is not there: nothing to compare its text with later
    here = "tests/test_testmap.py"
    assert build.merge(old, new, [here])["merged"] == {here: testmap.digest((testmap.REPO / here).read_text())}
