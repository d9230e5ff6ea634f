"""The code-validation sandbox: correct and wrong programs, answer comparison, and hostile programs that must fail fast."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from nip_like.errors import ConfigError
from nip_like.scenarios.code_validation.sandbox import (
    ProgramRun,
    SandboxLimits,
    TestSuite,
    child_environment,
    run_program,
    run_programs,
    text_digest,
    value_digest,
)
from nip_like.scenarios.code_validation.harness import canonical_value
from tests.test_sandbox_isolation import listener

#: Small limits, so that a looping program costs a fraction of a second.
FAST = SandboxLimits(time_limit=0.8, test_time_limit=0.2)
#: Smaller ones for the hostile programs (still ten times what a program needs to start).
HOSTILE_LIMITS = SandboxLimits(time_limit=0.5, test_time_limit=0.1)

ADD = TestSuite(inputs=[[1, 2], [3, 4]], outputs=[3, 7], fn_name="add")
ADD_ONCE = TestSuite(inputs=[[1, 2]], outputs=[3], fn_name="add")


def run_add(body: str, limits: SandboxLimits = FAST, suite: TestSuite = ADD) -> ProgramRun:
    """Run ``def add(a, b):`` with ``body`` (indented here) on ``suite``."""
    source = "def add(a, b):\n" + "".join(f"    {line}\n" for line in body.strip("\n").splitlines())
    return run_program(source, suite, limits)


def test_a_correct_program_passes_and_a_wrong_one_fails_with_its_answer():
    good = run_add("return a + b")
    assert good.passed and good.num_passed == 2 and good.reason == ""
    bad = run_add("return a - b")
    assert not bad.passed and bad.num_passed == 0
    assert bad.outcomes[0].reason == "wrong answer: got -1"
    assert bad.reason == "test 0: wrong answer: got -1"


def test_each_test_is_judged_on_its_own():
    run = run_add("return 3")
    assert [outcome.passed for outcome in run.outcomes] == [True, False]
    assert run.reason == "test 1: wrong answer: got 3"


def test_answers_compare_as_python_values_with_tuples_as_lists():
    assert canonical_value((1, True, 2.0, [None, "x"])) == [1, 1, 2, [None, "x"]]
    assert value_digest((1, 2)) == value_digest([1, 2]) != value_digest([2, 1])
    assert value_digest(2.5) != value_digest(2)
    with pytest.raises(TypeError, match="set"):
        canonical_value({1, 2})
    run = run_add("return {a, b}")
    assert run.outcomes[0].reason.startswith("error: TypeError: the answer is a set")


def test_standard_input_programs_are_run_once_per_test_and_their_output_compared():
    suite = TestSuite(inputs=["1 2\n", "3 4\n"], outputs=["3\n", ["7"]])
    source = "import sys\na, b = map(int, sys.stdin.buffer.readline().split())\nprint(a + b, ' ')\nexit()\n"
    assert run_program(source, suite, FAST).passed
    wrong = run_program("a, b = map(int, input().split())\nprint(a * b)\n", suite, FAST)
    assert wrong.outcomes[0].reason == "wrong answer: got '2\\n'"
    failed = run_program("import sys\nsys.exit(3)\n", suite, FAST)
    assert failed.outcomes[0].reason == "error: SystemExit: 3"
    assert text_digest(" 3 \n\n") == text_digest("3")


def test_the_apps_rule_accepts_the_first_element_of_a_list_answer_only_when_asked():
    strict = TestSuite(inputs=[[5]], outputs=[[5]], fn_name="f")
    lenient = TestSuite(inputs=[[5]], outputs=[[5]], fn_name="f", lenient_lists=True)
    source = "def f(x):\n    return x\n"
    assert not run_program(source, strict, FAST).passed
    assert run_program(source, lenient, FAST).passed


def test_a_class_solution_method_is_found():
    source = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
    assert run_program(source, ADD, FAST).passed


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("def add(a, b)\n    return 1\n", r"failed to load: SyntaxError"),
        ("def plus(a, b):\n    return a + b\n", r"defines no function add"),
        ("import socket\ndef add(a, b):\n    return a + b\n", r"does not allow importing socket"),
        ("while True:\n    pass\n", r"failed to load: time limit exceeded while loading"),
    ],
)
def test_a_program_that_does_not_load_fails_every_test(source, reason):
    run = run_program(source, ADD, HOSTILE_LIMITS)
    assert len(run.outcomes) == 2 and not any(outcome.passed for outcome in run.outcomes)
    assert all(outcome.reason.startswith("error: the program failed to load") for outcome in run.outcomes)
    assert re.search(reason, run.outcomes[0].reason)


def test_stop_at_first_failure_skips_the_rest():
    suite = TestSuite(inputs=[[1], [2], [3]], outputs=[1, 5, 3], fn_name="f")
    run = run_program("def f(x):\n    return x\n", suite, FAST, stop_at_first_failure=True)
    assert [outcome.passed for outcome in run.outcomes] == [True, False, False]
    assert run.outcomes[2].reason == "not run (stopped at the first failure)"


# ---------------------------------------------------------------- hostile programs

HOSTILE = {
    "infinite loop": ("while True:\n    pass", r"^time limit exceeded \(the test used more than 0.1 s of CPU\)$"),
    "loop that swallows the alarm": (
        "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass",
        r"^time limit exceeded \(the program ran past 0.5 s\)$",
    ),
    "sleep": ("import time\ntime.sleep(60)", r"^time limit exceeded \(the program ran past 0.5 s\)$"),
    "megabytes printed": ("while True:\n    print('x' * 10**6)", r"^output limit exceeded \(more than 64 KiB"),
    "megabytes written to fd 1": (
        "import os\nwhile True:\n    os.write(1, b'x' * 10**6)",
        r"^output limit exceeded \(more than 64 KiB",
    ),
    "fork": ("import os\nif os.fork() == 0:\n    os._exit(0)\nreturn a + b", r"module 'os' has no attribute 'fork'"),
    "fork through posix": ("import posix\nposix.fork()\nreturn a + b", r"module 'posix' has no attribute 'fork'"),
    "os.system": ("import os\nos.system('true')\nreturn a + b", r"module 'os' has no attribute 'system'"),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])", r"does not allow importing subprocess"),
    "multiprocessing": ("import multiprocessing\nreturn a + b", r"does not allow importing multiprocessing"),
    "ctypes": ("import ctypes\nreturn a + b", r"does not allow importing ctypes"),
    "huge allocation": ("x = bytearray(10**10)\nreturn a + b", r"^error: MemoryError$"),
    "huge list": ("x = [0] * 10**9\nreturn a + b", r"^error: MemoryError$"),
    "sys.exit": ("import sys\nsys.exit(0)", r"^error: SystemExit: 0$"),
    "os._exit": ("import os\nos._exit(0)", r"module 'os' has no attribute '_exit'"),
    "kill the parent": ("import os\nos.kill(os.getppid(), 9)", r"module 'os' has no attribute 'kill'"),
    "raise": ("raise ValueError('nope')", r"^error: ValueError: nope$"),
    "read stdin": ("return int(input()) + a + b", r"^error: EOFError"),
    "read stdin fd": ("import os\nreturn len(os.read(0, 10)) + 100", r"^wrong answer: got 100$"),
    "list the root": ("import os\nreturn os.listdir('/')", r"does not allow access to '/'"),
    "read /etc/passwd": ("return open('/etc/passwd').read()", r"does not allow access to '/etc/passwd'"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_program_fails_with_a_reason_and_the_runner_returns_promptly(name):
    body, reason = HOSTILE[name]
    started = time.monotonic()
    run = run_add(body, HOSTILE_LIMITS, ADD_ONCE)
    elapsed = time.monotonic() - started
    assert not run.passed
    assert re.search(reason, run.outcomes[0].reason), run.outcomes[0].reason
    assert elapsed < HOSTILE_LIMITS.time_limit + 5.0  # promptly: not a hang; the margin is for a loaded machine


def test_a_crash_fails_the_remaining_tests_and_keeps_the_earlier_results():
    body = "if a == 3:\n    import faulthandler\n    faulthandler._sigsegv()\nreturn a + b"
    run = run_add(body)
    assert run.outcomes[0].passed
    assert run.outcomes[1].reason == "the process was killed by SIGSEGV (a crash, e.g. a stack overflow)"


def test_a_program_cannot_write_to_or_list_the_run_folder(tmp_path):
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    (run_folder / "summary.json").write_text("{}")
    target = run_folder / "escaped.txt"
    writes = run_add(f"open({str(target)!r}, 'w').write('x')\nreturn a + b")
    assert "does not allow access" in writes.outcomes[0].reason
    removes = run_add(f"import os\nos.remove({str(run_folder / 'summary.json')!r})\nreturn a + b")
    assert "does not allow access" in removes.outcomes[0].reason
    lists = run_add(f"import os\nreturn os.listdir({str(run_folder)!r})")
    assert "does not allow access" in lists.outcomes[0].reason
    climbs = run_add("import os\nos.chdir('..')\nreturn a + b")
    assert "does not allow access to '..'" in climbs.outcomes[0].reason
    assert not target.exists() and (run_folder / "summary.json").read_text() == "{}"
    assert sorted(path.name for path in run_folder.iterdir()) == ["summary.json"]


def test_a_program_works_in_a_fresh_temporary_folder_that_is_removed_afterwards():
    suite = TestSuite(inputs=[[]], outputs=["x"], fn_name="f")
    source = (
        "import os\ndef f():\n    open('scratch.txt', 'w').write('x')\n"
        "    return open('scratch.txt').read() if os.listdir('.') == ['scratch.txt'] else os.listdir('.')\n"
    )
    assert run_program(source, suite, FAST).passed
    where = TestSuite(inputs=[[]], outputs=[""], fn_name="f")
    first = run_program("import os\ndef f():\n    return os.getcwd()\n", where, FAST).outcomes[0].reason
    folder = Path(first.removeprefix("wrong answer: got ").strip("'"))
    assert folder.name == "program" and folder.parent.name.startswith("nip_like_sandbox_")
    assert not folder.parent.exists()


#: A correct program for each module of the standard library that a solution commonly needs: each reads a line
#: of standard input, uses its module, and prints the sum of the line's numbers.
STANDARD_LIBRARY = {
    "pathlib": "import pathlib\npathlib.Path('numbers.txt').write_text(input())\nprint(sum(map(int, pathlib.Path('numbers.txt').read_text().split())))",
    "collections": "import collections\nprint(sum(k * v for k, v in collections.Counter(map(int, input().split())).items()))",
    "itertools": "import itertools\nprint(list(itertools.accumulate(map(int, input().split())))[-1])",
    "math": "import math\nprint(math.fsum(map(int, input().split())).__int__())",
    "re": "import re\nprint(sum(int(x) for x in re.findall(r'-?\\d+', input())))",
    "functools": "import functools, operator\nprint(functools.reduce(operator.add, map(int, input().split())))",
    "heapq": "import heapq\nh = list(map(int, input().split()))\nheapq.heapify(h)\nprint(sum(heapq.heappop(h) for _ in range(len(h))))",
    "bisect": "import bisect\ns = []\nfor x in map(int, input().split()):\n    bisect.insort(s, x)\nprint(sum(s))",
    "string": "import string\nprint(sum(int(x.strip(string.whitespace)) for x in input().split()))",
    "fractions": "from fractions import Fraction\nprint(int(sum(Fraction(x) for x in input().split())))",
    "decimal": "from decimal import Decimal\nprint(int(sum(Decimal(x) for x in input().split())))",
    "statistics": "import statistics\nxs = list(map(int, input().split()))\nprint(round(statistics.mean(xs) * len(xs)))",
    "operator": "import operator\nprint(sum(map(operator.pos, map(int, input().split()))))",
    "typing": "from typing import List\ndef total(xs: List[int]) -> int:\n    return sum(xs)\nprint(total(list(map(int, input().split()))))",
    "dataclasses": "from dataclasses import dataclass\n@dataclass\nclass N:\n    v: int\nprint(sum(N(int(x)).v for x in input().split()))",
    "copy": "import copy\nxs = list(map(int, input().split()))\nprint(sum(copy.deepcopy(xs)))",
    "random": "import random\nxs = list(map(int, input().split()))\nrandom.Random(0).shuffle(xs)\nprint(sum(xs))",
    "sys.stdin": "import sys\nprint(sum(int(x) for line in sys.stdin for x in line.split()))",
}
SUMS = TestSuite(inputs=["1 2 3\n", "-4 10\n"], outputs=["6", "6"])


def test_a_correct_program_using_the_common_standard_library_passes():
    modules = [name.partition(".")[0] for name in STANDARD_LIBRARY]
    source = f"import {', '.join(modules)}\nprint(sum(map(int, sys.stdin.readline().split())))\n"
    assert run_program(source, SUMS, FAST).passed


@pytest.mark.slow  # one program per module: a couple of seconds
def test_a_correct_program_using_each_module_of_the_common_standard_library_is_labelled_correct():
    runs = run_programs([(source + "\n", SUMS) for source in STANDARD_LIBRARY.values()], FAST, workers=2)
    assert {name: run.reason for name, run in zip(STANDARD_LIBRARY, runs)} == {name: "" for name in STANDARD_LIBRARY}


def test_the_environment_is_built_from_scratch_without_proxies(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:1")
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    expected = sorted(child_environment("/x"))
    suite = TestSuite(inputs=[[]], outputs=[expected], fn_name="f")
    assert run_program("import os\ndef f():\n    return sorted(os.environ)\n", suite, FAST).passed
    assert "no_proxy" in expected and not any("TOKEN" in name or "HTTPS" in name for name in expected)


def test_a_socket_cannot_reach_a_listening_port_on_localhost():
    with listener() as server:
        port = server.getsockname()[1]
        body = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nreturn a + b"
        run = run_add(body)
        assert "does not allow importing socket" in run.outcomes[0].reason
        with pytest.raises(BlockingIOError):
            server.accept()


def test_run_programs_keeps_the_order_and_does_not_depend_on_workers():
    jobs = [("def add(a, b):\n    return a + b\n", ADD), ("def add(a, b):\n    return a * b\n", ADD)] * 2
    one = run_programs(jobs, FAST, workers=1)
    two = run_programs(jobs, FAST, workers=2)
    assert [run.passed for run in one] == [True, False, True, False]
    assert [run.outcomes for run in one] == [run.outcomes for run in two]
    with pytest.raises(ConfigError, match="workers must be an integer >= 1"):
        run_programs(jobs, FAST, workers=0)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"time_limit": 0}, "time_limit"), ({"test_time_limit": -1.0}, "test_time_limit"),
     ({"memory_mib": 8}, "memory_mib"), ({"output_kib": 0}, "output_kib"), ({"open_files": True}, "open_files")],
)
def test_bad_limits_are_refused_naming_the_field(fields, named):
    with pytest.raises(ConfigError, match=rf"^SandboxLimits\.{named} must be"):
        SandboxLimits(**fields)


def test_a_suite_needs_one_output_per_input():
    with pytest.raises(ValueError, match="one output per input"):
        TestSuite(inputs=[[1]], outputs=[1, 2], fn_name="f")
    with pytest.raises(ValueError, match="must be strings"):
        TestSuite(inputs=[[1]], outputs=["1"])
