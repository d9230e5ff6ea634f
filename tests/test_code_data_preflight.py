"""A Buggy-APPS data file that means nothing sound is refused by the scenario's preflight, before the run folder.

:func:`nip_like.experiment.preflight` is what ``python -m nip_like`` runs before
Hydra makes the run folder; the file's checks themselves are in ``test_code_dataset``.
"""

from __future__ import annotations

import json
import re

import pytest

from nip_like.errors import ConfigError
from nip_like.experiment import preflight
from nip_like.validation import build_scenario
from tests.conftest import make_config

#: A call-style problem whose first test is sound and whose second expects nothing (``null``).
NULL_OUTPUT = {
    "question": "Return the number itself.",
    "solutions": ["def same(x):\n    return x\n"],
    "buggy_solutions": ["def same(x):\n    return x + 1\n"],
    "input_output": {"fn_name": "same", "inputs": [[3], [4]], "outputs": [3, None]},
}


def data_file_config(tmp_path, path, *overrides: str):
    """Text agents under ``nip`` on the data file ``path``."""
    return make_config(
        "scenario=code_validation", "trainer=expert_iteration", "protocol=nip", f"scenario.cache_dir={tmp_path / 'cache'}",
        f"scenario.data_file={path}", "run.progress_bar=false", *overrides,
    )


def refusal(tmp_path, record: dict) -> str:
    """The one-line ConfigError that preflight gives a data file holding ``record`` on its third line."""
    path = tmp_path / "apps.jsonl"
    sound = {**NULL_OUTPUT, "input_output": {"fn_name": "same", "inputs": [[3]], "outputs": [3]}}
    path.write_text("\n".join(json.dumps(line) for line in ({**sound, "problem_id": 1}, {**sound, "problem_id": 2}, record)))
    config = data_file_config(tmp_path, path)
    with pytest.raises(ConfigError) as error:
        preflight(config)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"scenario.data_file is not a Buggy-APPS JSONL file: {path}")
    return message


def test_a_null_expected_output_is_refused_naming_the_line_and_the_field(tmp_path):
    message = refusal(tmp_path, NULL_OUTPUT)
    assert message.endswith("line 3: field 'input_output.outputs[1]' is null: every test needs the answer it expects (1 of 2 are null)")


def test_problems_without_programs_are_refused_without_naming_num_problems(tmp_path):
    path = tmp_path / "apps.jsonl"
    path.write_text(json.dumps({**NULL_OUTPUT, "solutions": [], "buggy_solutions": [],
                                "input_output": {"fn_name": "same", "inputs": [[3]], "outputs": [3]}}) + "\n")
    config = data_file_config(tmp_path, path)
    with pytest.raises(ConfigError, match=re.escape(f"the Buggy-APPS file {path} holds 1 problems but no program")) as error:
        preflight(config)
    assert "num_problems" not in str(error.value)


def test_a_data_file_too_small_for_its_splits_names_the_file_not_num_problems(tmp_path):
    path = tmp_path / "apps.jsonl"
    sound = {**NULL_OUTPUT, "input_output": {"fn_name": "same", "inputs": [[3]], "outputs": [3]}}
    path.write_text("".join(json.dumps({**sound, "problem_id": index}) + "\n" for index in range(2)))
    scenario = build_scenario(data_file_config(tmp_path, path, "scenario.label_by=field"))
    with pytest.raises(ConfigError) as error:
        scenario.splits()
    assert str(error.value).startswith("the code-validation data has 2 problems, too few for a ")
    assert str(error.value).endswith(": raise the problems of scenario.data_file or the split's fraction")
    assert "num_problems" not in str(error.value)
