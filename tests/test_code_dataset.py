"""Code-validation data: the problem family, mutations, labels from execution, splits, cache, Buggy-APPS JSONL."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np
import pytest

from nip_like.checkpoint import load_checked, save_atomic
from nip_like.errors import ConfigError
from nip_like.scenarios.code_validation import data
from nip_like.scenarios.code_validation.data import (
    REFERENCE,
    BuggyAppsSpec,
    CodeValidationData,
    CodeValidationSpec,
    cache_path,
    generate_programs,
    label_buggy_apps,
    load_buggy_apps,
    load_or_generate,
    split_by_problem,
    statistics,
)
from nip_like.scenarios.code_validation.buggy_apps import read_buggy_apps, write_buggy_apps
from nip_like.scenarios.code_validation.mutations import (
    MUTATIONS,
    apply_site,
    draw_mutants,
    mutation_sites,
    normalise_source,
    rewrite,
)
from nip_like.scenarios.code_validation.problems import (
    TEMPLATES,
    all_problems,
    draw_problems,
    draw_tests,
    make_problem,
    reference_outputs,
)
from nip_like.scenarios.code_validation.sandbox import SandboxLimits, TestSuite, run_program, run_programs
from nip_like.scenarios.datasets import DatasetFileError
from tests import dataset_checks as checks

TINY = CodeValidationSpec(num_problems=4, correct_per_problem=1, mutants_per_problem=2, tests_per_problem=6, seed=3)
SMALLEST = CodeValidationSpec(num_problems=2, correct_per_problem=1, mutants_per_problem=1, tests_per_problem=3, seed=5)
LIMITS = SandboxLimits(time_limit=2.0, test_time_limit=0.2)


@pytest.fixture(scope="module")
def tiny() -> CodeValidationData:
    return generate_programs(TINY)


def problem(problem_id: str):
    return next(item for item in all_problems() if item.problem_id == problem_id)


# ---------------------------------------------------------------- the family and the mutations


def test_the_family_is_documented_size_and_every_problem_is_unique():
    problems = all_problems()
    assert len(TEMPLATES) == 37 and len(problems) == 115
    assert len({item.problem_id for item in problems}) == len(problems)
    assert len({item.task for item in problems}) == len(problems)  # no two problems share a statement
    for item in problems:
        assert item.signature.startswith(item.fn_name + "(") and "$" not in item.task + item.solution


def test_the_reference_solution_of_every_template_passes_its_tests_in_the_sandbox():
    rng = np.random.default_rng(0)
    chosen = [make_problem(template, len(template.variants) - 1) for template in TEMPLATES]
    jobs = []
    for item in chosen:
        tests = draw_tests(item, rng, 8)
        jobs.append((normalise_source(item.solution), TestSuite(tests, reference_outputs(item, tests), item.fn_name)))
    runs = run_programs(jobs, LIMITS, workers=2)
    assert [(item.problem_id, run.reason) for item, run in zip(chosen, runs) if not run.passed] == []


@pytest.mark.slow
def test_the_reference_solution_of_every_problem_passes_its_tests_in_the_sandbox():
    rng = np.random.default_rng(1)
    jobs = []
    for item in all_problems():
        tests = draw_tests(item, rng, 12)
        jobs.append((rewrite(item.solution, rng), TestSuite(tests, reference_outputs(item, tests), item.fn_name)))
    runs = run_programs(jobs, LIMITS, workers=2)
    assert [run.reason for run in runs if not run.passed] == []


def test_draw_problems_cycles_through_the_templates_and_refuses_too_many():
    drawn = draw_problems(np.random.default_rng(0), len(TEMPLATES) + 3)
    templates = [item.template for item in drawn]
    assert set(templates[: len(TEMPLATES)]) == {template.name for template in TEMPLATES}
    assert len({item.problem_id for item in drawn}) == len(drawn)
    with pytest.raises(ConfigError, match="has 115 problems; cannot draw 116"):
        draw_problems(np.random.default_rng(0), 116)


def test_tests_start_with_the_edge_cases_and_are_distinct():
    item = problem("count_above/3")  # k = 3
    tests = draw_tests(item, np.random.default_rng(0), 10)
    assert tests[:3] == [[[]], [[3]], [[4, 2]]]
    assert len({repr(test) for test in tests}) == 10
    assert reference_outputs(item, tests[:3]) == [0, 0, 1]


def test_every_mutation_applies_somewhere_in_the_family():
    solutions = [make_problem(template, 0).solution for template in TEMPLATES]
    used = {site.mutation for solution in solutions for site in mutation_sites(ast.parse(solution))}
    assert used == {mutation.name for mutation in MUTATIONS}


def test_a_mutation_changes_one_place():
    tree = ast.parse(problem("count_above/3").solution)
    relaxed = [site for site in mutation_sites(tree) if site.mutation == "relax_comparison"]
    assert len(relaxed) == 1
    assert "if x >= 3:" in ast.unparse(apply_site(tree, relaxed[0]))
    assert "if x > 3:" in ast.unparse(tree)  # the original is unchanged


def test_draw_mutants_gives_distinct_compiling_mutants_that_differ_from_the_source():
    source = problem("merge/0").solution
    mutants = draw_mutants(source, np.random.default_rng(0), 12)
    texts = [text for _, text in mutants]
    assert len(mutants) == 12 and len(set(texts)) == 12 and normalise_source(source) not in texts
    assert {name for name, _ in mutants} <= {mutation.name for mutation in MUTATIONS}
    for text in texts:
        compile(text, "<mutant>", "exec")


def test_a_rewrite_keeps_the_meaning_and_changes_the_surface():
    item = problem("run_length/1")
    tests = draw_tests(item, np.random.default_rng(0), 10)
    suite = TestSuite(tests, reference_outputs(item, tests), item.fn_name)
    rewritten = {rewrite(item.solution, np.random.default_rng(seed)) for seed in range(6)}
    assert len(rewritten) > 3
    assert all(run.passed for run in run_programs([(text, suite) for text in rewritten], LIMITS))


# ---------------------------------------------------------------- labels come from running the tests

FACTORIAL = "def factorial_mod(n):\n    result = 1\n    for i in range({}):\n        result = result * i % 1000000007\n    return result\n"
KNOWN_BUG = FACTORIAL.format("2, n")  # wrong for every n >= 3
EQUIVALENT = FACTORIAL.format("1, n + 1")  # multiplies by 1 once more


def test_a_buggy_mutant_is_labelled_0_and_an_equivalent_one_1_by_their_tests(monkeypatch):
    """The generator's intent (both are mutants, and the reference is broken on purpose) does not decide the label."""
    factorial = problem("factorial_mod/3")  # modulo 10**9 + 7
    assert "range(2, n + 1)" in factorial.solution
    monkeypatch.setattr(data, "draw_problems", lambda rng, count: [factorial, problem("count_above/3")][:count])
    monkeypatch.setattr(data, "draw_mutants", lambda source, rng, count: [
        ("off_by_one_range", KNOWN_BUG), ("off_by_one_range", EQUIVALENT)
    ] if "factorial" in source else [("flip_comparison", source.replace("x > 3", "x <= 3"))])
    broken = lambda source, rng: source.replace("return count", "return count + 1")  # noqa: E731
    monkeypatch.setattr(data, "rewrite", broken)
    built = generate_programs(CodeValidationSpec(num_problems=2, correct_per_problem=1, mutants_per_problem=2,
                                                 tests_per_problem=6))
    by_source = {program.source: program for program in built.programs}
    assert by_source[KNOWN_BUG].label is False and by_source[KNOWN_BUG].origin == "off_by_one_range"
    assert by_source[KNOWN_BUG].reason.startswith("test ") and "wrong answer" in by_source[KNOWN_BUG].reason
    assert by_source[EQUIVALENT].label is True and by_source[EQUIVALENT].origin == "off_by_one_range"
    assert by_source[factorial.solution].label is True and by_source[factorial.solution].origin == REFERENCE
    broken_reference = [p for p in built.programs if p.problem_id == "count_above/3" and p.origin == REFERENCE]
    assert len(broken_reference) == 1 and broken_reference[0].label is False  # a reference that fails is 0


def test_the_tiny_dataset_has_its_shape_and_labels_that_rerunning_confirms(tiny):
    assert len(tiny.problems) == 4 and 4 <= len(tiny) <= 12
    stats = statistics(tiny)
    assert stats["programs"] == len(tiny) and stats["correct"] + stats["buggy"] == len(tiny)
    assert stats["by_origin"][REFERENCE] == {"programs": 4, "correct": 4}
    jobs = [(program.source, tiny.problems[program.problem_id].suite()) for program in tiny.programs]
    runs = run_programs(jobs, LIMITS, stop_at_first_failure=True, workers=2)
    assert [run.passed for run in runs] == tiny.label.tolist()
    for program in tiny.programs:
        assert program.source == normalise_source(program.source)
        assert (program.reason == "") == program.label
    for item in tiny.problems.values():
        assert item.statement.startswith(f"Write a Python function `def {item.fn_name}(") and "Example:" in item.statement
        assert len(item.inputs) == len(item.outputs) == 6


def test_the_same_spec_gives_the_same_dataset_and_another_seed_another():
    first = generate_programs(SMALLEST)
    assert generate_programs(SMALLEST).checksum() == first.checksum()
    assert generate_programs(CodeValidationSpec(**{**SMALLEST.to_dict(), "seed": 6})).checksum() != first.checksum()


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"num_problems": 1}, "num_problems"), ({"num_problems": 116}, "num_problems"),
     ({"mutants_per_problem": 0}, "mutants_per_problem"), ({"tests_per_problem": 2.5}, "tests_per_problem"),
     ({"test_time_limit": 0}, "test_time_limit"), ({"seed": -1}, "seed"), ({"memory_mib": 10}, "memory_mib")],
)
def test_bad_spec_fields_are_refused_in_one_line(fields, named):
    with pytest.raises(ConfigError, match=rf"^CodeValidationSpec\.{named} must be [^\n]*$"):
        CodeValidationSpec(**fields)


def test_the_documented_defaults():
    spec = CodeValidationSpec()
    assert (spec.num_problems, spec.correct_per_problem, spec.mutants_per_problem, spec.tests_per_problem) == (60, 2, 3, 12)
    assert (spec.seed, spec.test_time_limit, spec.time_limit, spec.memory_mib) == (0, 0.1, 5.0, 256)


# ---------------------------------------------------------------- splits


def test_splits_by_problem_share_no_problem_and_hold_every_program_once(tiny):
    splits = split_by_problem(tiny, {"train": 0.5, "val": 0.25, "test": 0.25}, seed=0)
    ids = {name: {program.problem_id for program in split.programs} for name, split in splits.items()}
    assert [len(value) for value in ids.values()] == [2, 1, 1]
    assert not (ids["train"] & ids["val"] or ids["train"] & ids["test"] or ids["val"] & ids["test"])
    assert sorted(program.source for split in splits.values() for program in split.programs) == sorted(
        program.source for program in tiny.programs
    )
    for name, split in splits.items():
        assert set(split.problems) == ids[name]
    again = split_by_problem(tiny, {"train": 0.5, "val": 0.25, "test": 0.25}, seed=0)
    assert [split.checksum() for split in again.values()] == [split.checksum() for split in splits.values()]
    with pytest.raises(ConfigError, match="sum to 1"):
        split_by_problem(tiny, {"train": 0.5, "test": 0.4}, seed=0)


# ---------------------------------------------------------------- files and the cache


def test_save_load_and_tampering(tiny, tmp_path):
    path = tmp_path / "programs.pt"
    tiny.save(path, metadata={"note": "x"})
    assert CodeValidationData.load(path).checksum() == tiny.checksum()
    state = load_checked(path)
    state["data"]["programs"][0]["label"] = not state["data"]["programs"][0]["label"]
    save_atomic(state, path)
    with pytest.raises(DatasetFileError, match="fails its checksum"):
        CodeValidationData.load(path)
    state["data"]["programs"][0]["label"] = "yes"
    save_atomic(state, path)
    with pytest.raises(DatasetFileError, match="malformed data"):
        CodeValidationData.load(path)
    path.write_bytes(b"garbage")
    with pytest.raises(DatasetFileError, match="code-validation file .* is damaged"):
        CodeValidationData.load(path)
    save_atomic({"something": "else"}, path)
    with pytest.raises(DatasetFileError, match="not a code-validation file"):
        CodeValidationData.load(path)
    with pytest.raises(DatasetFileError, match="no code-validation file at"):
        CodeValidationData.load(tmp_path / "missing.pt")


def flip_first_label(path: Path) -> None:
    state = load_checked(path)
    state["data"]["programs"][0]["label"] = not state["data"]["programs"][0]["label"]
    save_atomic(state, path)  # the file's own checksum is right; only the data's checksum tells


def other_spec(path: Path) -> None:
    state = load_checked(path)
    state["metadata"]["spec"]["seed"] = 99
    save_atomic(state, path)


def test_a_second_load_reads_the_cache(tmp_path, monkeypatch):
    path = cache_path(SMALLEST, tmp_path)
    load = lambda: load_or_generate(SMALLEST, tmp_path)  # noqa: E731
    checks.check_second_call_loads(load, path, lambda: checks.forbid(monkeypatch, data, "generate_programs"))


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [(checks.corrupt_truncated, "is damaged"), (checks.corrupt_garbage, "is damaged"),
     (flip_first_label, "fails its checksum"), (other_spec, r"written for another spec \(seed=99 not 5\)")],
)
def test_a_bad_cache_is_rebuilt_with_a_warning(tmp_path, monkeypatch, corrupt, reason):
    load = lambda: load_or_generate(SMALLEST, tmp_path)  # noqa: E731
    forbid = lambda: checks.forbid(monkeypatch, data, "generate_programs")  # noqa: E731
    checks.check_bad_cache_is_rebuilt(load, cache_path(SMALLEST, tmp_path), corrupt, reason, forbid)


# ---------------------------------------------------------------- Buggy-APPS JSONL

STDIN_RECORD = {
    "problem_id": 7,
    "question": "Read two integers and print their sum.",
    "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)\n",
                             "a, b = map(int, input().split())\nprint(a * b)\n"]),
    "buggy_solutions": ["a, b = map(int, input().split())\nprint(a - b)\n",
                        "print(sum(map(int, input().split())))\n"],
    "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}),
}
CALL_RECORD = {
    "question": "Return the list doubled.",
    "solutions": ["def double(xs):\n    return [2 * x for x in xs]\n"],
    "buggy_solutions": ["def double(xs):\n    return xs + xs\n"],
    "input_output": {"fn_name": "double", "inputs": [[[1, 2]], [[]]], "outputs": [[[2, 4]], [[]]]},
}


def write_lines(path: Path, records: list) -> Path:
    path.write_text("\n".join(record if isinstance(record, str) else json.dumps(record) for record in records) + "\n")
    return path


def test_a_buggy_apps_file_is_labelled_by_its_tests(tmp_path):
    path = write_lines(tmp_path / "apps.jsonl", [STDIN_RECORD, "", CALL_RECORD])
    labelled = label_buggy_apps(path, BuggyAppsSpec(test_time_limit=0.5, time_limit=2.0))
    assert list(labelled.problems) == ["7", "line-3"]
    assert labelled.problems["line-3"].fn_name == "double" and labelled.problems["7"].fn_name is None
    assert [(program.origin, program.label) for program in labelled.programs] == [
        ("solution", True), ("solution", False), ("buggy_solution", False), ("buggy_solution", True),
        ("solution", True), ("buggy_solution", False),
    ]
    assert labelled.programs[1].reason == "test 0: wrong answer: got '2\\n'"
    trusted = label_buggy_apps(path, BuggyAppsSpec(label_by="field"))
    assert [program.label for program in trusted.programs] == [True, True, False, False, True, False]


def test_a_buggy_apps_file_is_cached_by_its_contents(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "apps.jsonl", [CALL_RECORD])
    first = load_buggy_apps(path, tmp_path / "cache", limits=LIMITS)
    monkeypatch.setattr(data, "label_buggy_apps", lambda *args: pytest.fail("labelled again"))
    assert load_buggy_apps(path, tmp_path / "cache", limits=LIMITS).checksum() == first.checksum()
    monkeypatch.undo()
    write_lines(path, [CALL_RECORD, STDIN_RECORD])
    assert len(load_buggy_apps(path, tmp_path / "cache", limits=LIMITS).problems) == 2
    assert len(list((tmp_path / "cache").glob("code_validation_*.pt"))) == 2


def test_a_generated_dataset_round_trips_through_the_buggy_apps_layout(tiny, tmp_path):
    path = tmp_path / "generated.jsonl"
    write_buggy_apps(tiny, path)
    back = label_buggy_apps(path, BuggyAppsSpec(label_by="field"))
    key = lambda program: (program.problem_id, program.source, program.label)  # noqa: E731
    assert sorted(map(key, back.programs)) == sorted(map(key, tiny.programs))
    retested = label_buggy_apps(path, BuggyAppsSpec(test_time_limit=0.2, time_limit=2.0))
    assert sorted(map(key, retested.programs)) == sorted(map(key, tiny.programs))


def bad(record: dict, **changes) -> dict:
    changed = {**record, **changes}
    return {key: value for key, value in changed.items() if value is not None}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"line 2 is not valid JSON"),
        ("[1, 2]", r"line 2 is not a JSON object"),
        (bad(CALL_RECORD, solutions=None), r"line 2: field 'solutions' is missing"),
        (bad(CALL_RECORD, question=""), r"line 2: field 'question' must be a non-empty string"),
        (bad(CALL_RECORD, buggy_solutions="[1,"), r"line 2: field 'buggy_solutions' is a string but not a JSON list"),
        (bad(CALL_RECORD, solutions=[1]), r"line 2: field 'solutions' must be a list of program sources"),
        (bad(CALL_RECORD, input_output="{"), r"line 2: field 'input_output' is not valid JSON"),
        (bad(CALL_RECORD, input_output={"inputs": [[1]], "outputs": [1, 2], "fn_name": "f"}),
         r"line 2: field 'input_output' has 1 inputs but 2 outputs"),
        (bad(CALL_RECORD, input_output={"inputs": [], "outputs": []}), r"line 2: field 'input_output.inputs' must be"),
        (bad(CALL_RECORD, input_output={"inputs": [[1]], "outputs": [1], "fn_name": "no name"}),
         r"line 2: field 'input_output.fn_name' must be a function name"),
        (bad(CALL_RECORD, input_output={"inputs": [3], "outputs": ["3"]}),
         r"line 2: field 'input_output.inputs\[0\]' must be text"),
        (bad(STDIN_RECORD), r"line 2: problem_id '7' is already used"),
        (bad(CALL_RECORD, input_output={"fn_name": "double", "inputs": [[[1]], [[2]]], "outputs": [3, None]}),
         r"line 2: field 'input_output.outputs\[1\]' is null: every test needs the answer it expects \(1 of 2"),
        (b"\xff\xfe{}".decode("latin-1"), r"line 2 is not UTF-8 text"),
    ],
)
def test_a_bad_buggy_apps_line_is_refused_naming_the_line_and_the_field(tmp_path, line, message):
    path = write_lines(tmp_path / "apps.jsonl", [STDIN_RECORD, line])
    if "UTF-8" in message:  # written as bytes that are not UTF-8
        path.write_bytes(path.read_text().encode("latin-1"))
    with pytest.raises(DatasetFileError, match=rf"^{re.escape(str(tmp_path))}/apps.jsonl {message}[^\n]*$"):
        read_buggy_apps(path)


def test_an_empty_or_missing_buggy_apps_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetFileError, match="holds no problems"):
        read_buggy_apps(tmp_path / "empty.jsonl")
    with pytest.raises(DatasetFileError, match="cannot read the Buggy-APPS file"):
        load_buggy_apps(tmp_path / "missing.jsonl")


def test_a_buggy_apps_file_without_programs_is_refused_saying_so(tmp_path):
    path = write_lines(tmp_path / "apps.jsonl", [bad(CALL_RECORD, solutions=[], buggy_solutions="[]")] * 1)
    with pytest.raises(DatasetFileError) as error:
        read_buggy_apps(path)
    assert str(error.value) == (
        f"the Buggy-APPS file {path} holds 1 problems but no program: the fields 'solutions' and 'buggy_solutions' "
        "are empty on every line"
    )
    assert "num_problems" not in str(error.value)


def test_a_buggy_apps_line_or_file_over_its_size_limit_is_refused_before_it_is_held(tmp_path, monkeypatch):
    from nip_like.scenarios.code_validation import buggy_apps

    monkeypatch.setattr(buggy_apps, "MAX_LINE_BYTES", 300)
    long_question = bad(CALL_RECORD, question="x" * 400)
    path = write_lines(tmp_path / "apps.jsonl", [CALL_RECORD, long_question])
    assert len(json.dumps(CALL_RECORD)) <= 300  # the first line fits
    read_lines = []
    real_readline = buggy_apps._numbered_lines

    def counting(path):
        for number, line in real_readline(path):
            read_lines.append(len(line))
            yield number, line

    monkeypatch.setattr(buggy_apps, "_numbered_lines", counting)
    with pytest.raises(DatasetFileError, match=rf"^{re.escape(str(path))} line 2 is over the limit of 0.000286102 MiB "
                                              r"\(MAX_LINE_BYTES in nip_like.scenarios.code_validation.buggy_apps\)$"):
        read_buggy_apps(path)
    assert max(read_lines) <= 300
    monkeypatch.setattr(buggy_apps, "MAX_LINE_BYTES", 1 << 20)
    monkeypatch.setattr(buggy_apps, "MAX_FILE_BYTES", 100)
    with pytest.raises(DatasetFileError, match=r"the Buggy-APPS file .*apps.jsonl \(0.0 MiB\) is over the limit .*MAX_FILE_BYTES"):
        read_buggy_apps(path)
    assert buggy_apps.file_sha256(path) == __import__("hashlib").sha256(path.read_bytes()).hexdigest()


def test_a_buggy_apps_file_whose_solutions_all_fail_is_refused_naming_the_problem(tmp_path):
    wrong_outputs = bad(CALL_RECORD, problem_id="wrong",
                        input_output={"fn_name": "double", "inputs": [[[1, 2]]], "outputs": [[[1, 2, 1, 2]]]})
    path = write_lines(tmp_path / "apps.jsonl", [STDIN_RECORD, wrong_outputs])
    with pytest.raises(DatasetFileError) as error:
        label_buggy_apps(path, BuggyAppsSpec(test_time_limit=0.5, time_limit=2.0))
    assert str(error.value).startswith(
        f"{path}: problem 'wrong': none of its 1 solutions passes its own tests (the first: test 0: wrong answer"
    )
    assert str(error.value).endswith("1 of 2 problems with solutions fail so") and "\n" not in str(error.value)
    # Trusting the file runs nothing and checks nothing.
    assert len(label_buggy_apps(path, BuggyAppsSpec(label_by="field"))) == 6


def test_the_package_imports_nothing():
    init = Path(data.__file__).with_name("__init__.py")
    tree = ast.parse(init.read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
