"""The code-validation scenario: protocols, prompts, the verifier's decisions, text trainers and chat-view LM agents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrl.envs.utils import check_env_specs, step_mdp

import nip_like.experiment as experiment
from nip_like import keys
from nip_like.cli import compose_config
from nip_like.errors import ConfigError
from nip_like.experiment import preflight, run_experiment
from nip_like.validation import build_scenario
from nip_like.registry import PROTOCOLS as REGISTERED_PROTOCOLS
from nip_like.scenarios.code_validation.chat_text import (
    LAST_TURN_NOTICE,
    datapoint_text,
    parse_decision,
    parse_reply,
    read_datapoint,
    sender_label,
)
from nip_like.scenarios.code_validation.text_agents import ScriptedCodeValidationModel, failure
from nip_like.scenarios.code_validation.dataset import CodeProgram
from nip_like.text.interface import Sampling, TextModelConfig
from nip_like.text.models import create_model_folder
from nip_like.text.rollouts import play_episodes, rollout_records
from nip_like.sweeps.grid import expand_sweep
from nip_like.text.tokenizer import build_chat_tokenizer
from nip_like.validation import validate
from tests.conftest import fast_trainers, make_config
from tests.test_duplicates_scenario import RL_TRAINERS
from tests.fake_servers import fake_server
from tests.script_modules import script_module

#: The generated family at its smallest useful size: 10 problems, 3 programs each, labelled by 4 hidden tests.
DATA = (
    "scenario.num_problems=10",
    "scenario.tests_per_problem=4",
    "scenario.correct_per_problem=1",
    "scenario.mutants_per_problem=2",
    "scenario.val_fraction=0.2",
    "scenario.test_fraction=0.2",
)
#: Each fitting protocol, with the turn orders of the paper where the protocol has them.
PROTOCOLS = {
    "nip": ["protocol=nip", "protocol.max_rounds=3"],
    "nip_prover_first": ["protocol=nip", "protocol.first_speaker=prover", "protocol.max_rounds=2"],
    "nip_verifier_asks_first": ["protocol=nip", "protocol.min_rounds=2", "protocol.max_rounds=3"],
    "adp": ["protocol=adp"],
    "debate": ["protocol=debate", "protocol.max_rounds=3"],
    "debate_prover_first": ["protocol=debate", "protocol.first_speaker=prover", "protocol.max_rounds=2"],
    "debate_sequential": ["protocol=debate", "protocol.sequential=true", "protocol.max_rounds=4"],
    "mnip": ["protocol=mnip", "protocol.max_rounds=3"],
    "mnip_sequential_prover1_first": [
        "protocol=mnip", "protocol.sequential=true", "protocol.prover0_first=false", "protocol.max_rounds=4"
    ],
    "merlin_arthur": ["protocol=merlin_arthur"],
    "solo_verifier": ["protocol=solo_verifier"],
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One data cache for the module: the family is labelled once."""
    return tmp_path_factory.mktemp("code_validation_cache")


def config(cache: Path, *overrides: str, trainer: str = "expert_iteration"):
    return make_config(
        "scenario=code_validation", f"trainer={trainer}", f"scenario.cache_dir={cache}", *DATA,
        "run.progress_bar=false", "run.num_threads=1", *overrides,
    )


def scripted_play(scenario, split: str = "train", episodes: int = 12, seed: int = 0):
    players = {agent: scenario.scripted_player(agent) for agent in scenario.agent_names}
    return play_episodes(scenario, players, {agent: Sampling(8) for agent in players}, split, episodes, seed, by_agent=True)


# ------------------------------------------------------------------ protocols and turn orders
@pytest.mark.parametrize("name", PROTOCOLS)
def test_the_scenario_plays_every_fitting_protocol_and_honest_play_decides_right(cache, name):
    scenario = build_scenario(config(cache, *PROTOCOLS[name]))
    env = scenario.make_text_env(4, "train", 0, "cpu")
    check_env_specs(env)
    rollouts = scripted_play(scenario)
    # The scripted verifier knows each program's label: every episode ends with the right decision.
    assert bool((rollouts["decision"] == rollouts["label"].long()).all())
    records = rollout_records(rollouts, scenario.agent_names)
    first = records[0]["turns"][0]
    speaks_first = scenario.protocol.agent_names[int(scenario.protocol.active_agents(torch.tensor(0)).float().argmax())]
    assert first["agent"] == speaks_first
    verifier = scenario.agent_names[scenario.protocol.verifier_index]
    for record in records:
        deciding = [turn for turn in record["turns"] if turn["agent"] == verifier][-1]
        assert deciding["move"] == record["decision"] and LAST_TURN_NOTICE in deciding["chat"][0]["content"]


def test_debate_provers_answer_at_once_and_the_verifier_first_asks(cache):
    scenario = build_scenario(config(cache, *PROTOCOLS["debate"]))
    record = rollout_records(scripted_play(scenario, episodes=4), scenario.agent_names)[0]
    assert [(turn["round"], turn["agent"]) for turn in record["turns"]] == [
        (0, "verifier"), (1, "prover0"), (1, "prover1"), (2, "verifier")
    ]
    # Simultaneous: prover1 does not read what prover0 says in the same round; the verifier reads both.
    assert "prover0:" not in record["turns"][2]["chat"][1]["content"]
    last = record["turns"][3]["chat"][1]["content"]
    assert "prover0: " in last and "prover1: " in last and record["turns"][0]["move"] == "message"


def test_sequential_debate_lets_the_second_prover_read_the_first(cache):
    scenario = build_scenario(config(cache, *PROTOCOLS["debate_sequential"]))
    record = rollout_records(scripted_play(scenario, episodes=4), scenario.agent_names)[0]
    assert [(turn["round"], turn["agent"]) for turn in record["turns"]] == [
        (0, "verifier"), (1, "prover0"), (2, "prover1"), (3, "verifier")
    ]
    # One after the other, in a public channel: prover1 reads prover0's message of the same round.
    assert "prover0: " in record["turns"][2]["chat"][1]["content"]


def test_mnip_provers_do_not_read_each_other_and_merlin_arthur_hides_who_spoke(cache):
    mnip = build_scenario(config(cache, *PROTOCOLS["mnip"]))
    record = rollout_records(scripted_play(mnip, episodes=4), mnip.agent_names)[0]
    verifier_last = record["turns"][-1]["chat"][1]["content"]
    assert "prover0: " in verifier_last and "prover1: " in verifier_last
    merlin = build_scenario(config(cache, *PROTOCOLS["merlin_arthur"]))
    assert sender_label(merlin.protocol, merlin.protocol.verifier_index, 0) == "expert"
    assert sender_label(merlin.protocol, 0, 0) == "prover0"
    for record in rollout_records(scripted_play(merlin, episodes=8), merlin.agent_names):
        speakers = [turn["agent"] for turn in record["turns"] if turn["agent"] != "verifier"]
        assert len(speakers) == 1  # one of the two provers, drawn per episode
        text = record["turns"][-1]["chat"][1]["content"]
        assert "expert: " in text and "prover" not in text.split("```")[-1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["protocol=solo_opening"], r"gives a verifier without provers nothing to open.*use protocol=solo_verifier"),
        (["protocol=prover_verifier"], r"needs an interactive-proof protocol"),
        (["protocol=nip", "protocol.zero_knowledge=true"], r"cannot play a zero-knowledge protocol"),
        (["protocol=nip", "+protocol.sequential=true"], r"unknown config keys \['protocol.sequential'\]"),
        (["protocol=debate", "protocol.prover0_first=false"], r"protocol.prover0_first is false but"),
        (["protocol=debate", "protocol.first_speaker=judge"], r"protocol.first_speaker"),
        (["protocol=nip", "+scenario.system_prompts.judge=x"], r"scenario.system_prompts names \['judge'\]"),
        (["protocol=nip", "scenario.num_problems=500"], r"scenario.num_problems must be in \[2, 115\]"),
        (["protocol=nip", "scenario.label_by=guess"], r"scenario.label_by"),
        (["protocol=nip", "+scenario.agent_groups.judge=x"], r"scenario.agent_groups names \['judge'\]"),
        (["protocol=nip", "+scenario.models.judge={}"], r"scenario.models names \['judge'\]"),
    ],
)
def test_bad_protocols_and_options_are_one_line(cache, overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        preflight(config(cache, *overrides))
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------ what agents read
def write_apps(path: Path, problems: int = 6) -> Path:
    """A Buggy-APPS file whose hidden tests hold values found nowhere else (to look for them in the prompts)."""
    lines = []
    for index in range(problems):
        record = {
            "problem_id": f"p{index}",
            "question": f"Return the sum of a and b (problem {index}).",
            "solutions": [f"def add(a, b):\n    return a + b  # {index}\n"],
            "buggy_solutions": [f"def add(a, b):\n    return a - b  # {index}\n"],
            "input_output": {"inputs": [[424242, 171717 + index]], "outputs": [595959 + index], "fn_name": "add"},
        }
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompts_hold_the_problem_and_the_program_and_never_the_label_or_the_hidden_tests(cache, tmp_path):
    data_file = write_apps(tmp_path / "apps.jsonl")
    scenario = build_scenario(config(
        cache, *PROTOCOLS["debate"], f"scenario.data_file={data_file}", "scenario.label_by=field",
    ))
    split = scenario.split("train")
    rollouts = scripted_play(scenario, episodes=16)
    seen_labels = set()
    for record in rollout_records(rollouts, scenario.agent_names):
        program = split.programs[record["list_index"]]
        statement = split.problems[program.problem_id].statement
        seen_labels.add(record["label"])
        for turn in record["turns"]:
            system, user = (message["content"] for message in turn["chat"])
            # The user message opens with the problem and the program, exactly; the system prompt is the role's.
            assert user.startswith(datapoint_text(statement, program.source))
            assert read_datapoint(user) == (statement, program.source)
            assert system.replace(" " + LAST_TURN_NOTICE, "") == scenario.system_prompt(turn["agent"])
            for hidden in ("424242", "171717", "595959", "label", "True", "False"):
                assert hidden not in system + user, (hidden, turn["agent"])
    assert seen_labels == {True, False}  # the same prompt layout for correct and buggy programs


def test_a_data_file_that_is_not_the_jsonl_layout_is_one_line(cache, tmp_path):
    bad = tmp_path / "programs.csv"
    bad.write_text("question,solution\nadd,def add(a, b): return a + b\n")
    with pytest.raises(ConfigError, match=r"^scenario.data_file is not a Buggy-APPS JSONL file: .*programs.csv line 1 is not valid JSON[^\n]*$"):
        preflight(config(cache, "protocol=nip", f"scenario.data_file={bad}"))
    missing_field = tmp_path / "missing.jsonl"
    missing_field.write_text(json.dumps({"question": "q", "solutions": [], "input_output": {"inputs": [1], "outputs": [1]}}) + "\n")
    with pytest.raises(ConfigError, match=r"^scenario.data_file is not a Buggy-APPS JSONL file: .* field 'buggy_solutions' is missing$"):
        preflight(config(cache, "protocol=nip", f"scenario.data_file={missing_field}"))
    with pytest.raises(ConfigError, match=r"^scenario.data_file: .* is not a file$"):
        preflight(config(cache, "protocol=nip", f"scenario.data_file={tmp_path / 'nothing.jsonl'}"))


# ------------------------------------------------------------------ the verifier's decision
@pytest.mark.parametrize(
    ("text", "decision"),
    [
        ("Decision: accept", "accept"),
        ("decision:REJECT.", "reject"),
        ("After reading the loop: Decision :  Accept", "accept"),
        ("Decision: reject. (Earlier I thought Decision: accept.)", "reject"),
        ("accept", "accept"),
        ("Reject, the index is off by one", "reject"),
        ("I accept that the loop ends", None),
        ("Decision: maybe", None),
        ("Question for the expert: why range(1, n)?", None),
        ("", None),
    ],
)
def test_the_verifier_decision_is_parsed_by_one_rule(text, decision):
    assert parse_decision(text) == decision
    assert parse_reply(text, is_verifier=True) == (decision or ("message" if text else "none"))
    # A prover's reply never decides.
    assert parse_reply(text, is_verifier=False) == ("message" if text else "none")


def test_an_undecided_last_turn_is_wrong_and_an_early_decision_does_not_count(cache):
    scenario = build_scenario(config(cache, *PROTOCOLS["nip_verifier_asks_first"], "protocol.verifier_incorrect_penalty=0.5"))
    env = scenario.make_text_env(2, "train", 0, "cpu")
    ids = scenario.move_ids()
    state = env.reset()
    # Round 0: the verifier accepts before it may decide (min_rounds=2): nothing happens.
    moves = [["accept"], ["message"]]
    state["agents", "action"] = torch.tensor([[[ids["pad"]], [ids[moves[0][0]]]]] * 2)
    state = env.step(state)
    assert state["next", "state", "decision"].tolist() == [-1, -1] and not bool(state["next", "done"].any())
    state = step_mdp(state)
    state["agents", "action"] = torch.tensor([[[ids["message"]], [ids["pad"]]]] * 2)
    state = step_mdp(env.step(state))
    # Its last turn: a message instead of a decision ends the episode undecided, with the penalty, no prover reward.
    state["agents", "action"] = torch.tensor([[[ids["pad"]], [ids["message"]]]] * 2)
    last = env.step(state)["next"]
    assert bool(last["done"].all()) and last["state", "decision"].tolist() == [-1, -1]
    assert last["agents", "reward"].squeeze(-1).tolist() == [[0.0, -0.5], [0.0, -0.5]]
    moves = scenario.reply_action("Decision: accept", scenario.protocol.verifier_index)
    assert moves == (["accept"], "accept") and scenario.reply_action("", 0) == ([], "none")
    assert scenario.encode_actions([["accept"], []]).tolist() == [[ids["accept"]], [ids["pad"]]]


def test_the_scripted_prover_names_how_a_program_fails_without_the_test():
    program = lambda label, reason: CodeProgram("p", "def f(): pass\n", label, "reference", reason)  # noqa: E731
    assert failure(program(False, "test 3: error: IndexError: list index out of range")) == "it raises IndexError: list index out of range"
    assert failure(program(False, "test 0: wrong answer: got [1, 2]")) == "it returns a wrong answer"
    assert failure(program(False, "test 1: time limit exceeded (the test used more than 0.1 s of CPU)")) == "it runs past the time limit"
    assert failure(program(True, "")) == "it returns a wrong answer"
    with pytest.raises(ConfigError, match="unknown role"):
        ScriptedCodeValidationModel("judge", {})


# ------------------------------------------------------------------ the text trainers
@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    """A tiny character-level chat model folder, built offline (random weights)."""
    sizes = TextModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    return create_model_folder(sizes, tmp_path_factory.mktemp("text_model") / "tiny", build_chat_tokenizer())


TEXT_RUN = (
    *PROTOCOLS["nip_prover_first"],
    "logger=csv",
    "scenario.default_model.max_new_tokens=24",
    "trainer.episodes=8",
    "trainer.test_episodes=8",
    "trainer.test_scheme=last",
)


def test_a_text_trainer_iteration_runs_end_to_end_with_a_local_model_folder(cache, text_folder, tmp_path):
    # One iteration: sample, statistics, test; the last iteration has no fine-tune job.
    run = config(cache, *TEXT_RUN, f"scenario.default_model.path={text_folder}", "trainer.num_iterations=1",
                 "trainer.warm_start_episodes=0")
    metrics = run_experiment(run, tmp_path / "run")
    assert {"test/accuracy", "test/decided", "test/agents/verifier/reward", "test/agents/prover/reply_chars"} <= set(metrics)
    lines = (tmp_path / "run" / "rollouts" / "iteration_0000.jsonl").read_text().splitlines()
    record = json.loads(lines[1])
    assert [turn["agent"] for turn in record["turns"]] == ["prover", "verifier"] and "values" not in record
    assert record["turns"][0]["chat"][1]["content"].startswith("## Problem")


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_a_text_trainer_iteration_runs_through_an_openai_compatible_server(cache, tmp_path):
    def reply(body: dict) -> str:
        system = body["messages"][0]["content"]
        return "Decision: accept" if system.startswith("Your task is to decide") else "The program is correct."

    with fake_server("ok", reply=reply) as server:
        run = config(cache, *TEXT_RUN, "scenario.default_model.backend=openai", f"scenario.default_model.base_url={server.url}",
                     "trainer.num_iterations=1", "trainer.warm_start_episodes=0")
        metrics = run_experiment(run, tmp_path / "run")
        chats = [body for kind, body in server.requests if kind == "chat"]
    assert metrics["test/decided"] == 1.0 and metrics["test/recall"] == 1.0
    assert metrics["test/accuracy"] == metrics["test/precision"]  # it accepts everything: accuracy is the share of correct programs
    assert all(body["messages"][1]["content"].startswith("## Problem") for body in chats)
    assert any(body["messages"][1]["content"].splitlines()[-1].startswith("prover: ") for body in chats)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["expert_iteration", "malt"])
def test_the_text_trainers_fine_tune_both_agents_on_code_validation(cache, text_folder, tmp_path, trainer):
    run = config(
        cache, *TEXT_RUN, f"scenario.default_model.path={text_folder}", "trainer.num_iterations=2",
        "trainer.warm_start_episodes=8", "trainer.warm_start_epochs=1", trainer=trainer,
        *(["trainer.objective.reward_threshold=0.0"] if trainer == "expert_iteration" else ["trainer.episodes=4"]),
    )
    metrics = run_experiment(run, tmp_path / "run")
    assert "test/accuracy" in metrics
    state = json.loads((tmp_path / "run" / "checkpoints" / "state.json").read_text())
    if trainer == "expert_iteration":  # the warm start (scripted honest play) fine-tuned both groups, then iteration 0's jobs
        assert state["groups"]["verifier"]["model"].endswith("it0000-verifier")
    else:  # MALT plays each program as a tree of 3 x 3 leaves (its DPO job needs sibling replies that differ in value)
        lines = (tmp_path / "run" / "rollouts" / "iteration_0000.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["episodes"] == 4 * 3**2
        assert state["groups"]["verifier"]["model"].rsplit("/", 1)[-1] in ("warm-verifier", "it0000-verifier")
    warm = (tmp_path / "run" / "datasets" / "warm_start_verifier.jsonl").read_text().splitlines()
    assert {json.loads(line)["messages"][-1]["content"] for line in warm} <= {"Decision: accept", "Decision: reject"}


# ------------------------------------------------------------------ the RL loop's chat-view agents
def rl_config(cache: Path, folder: Path, *overrides: str, trainer: str = "ppo"):
    return config(
        cache, *PROTOCOLS["nip_prover_first"],
        f"scenario.default_agent.pretrained_path={folder}", "scenario.default_agent.max_new_tokens=12",
        "scenario.quote_tokens=16", "logger=none",
        "trainer.num_envs=4", "trainer.frames_per_batch=8", "trainer.minibatch_size=8", "trainer.num_iterations=1",
        "trainer.eval.every=0", "trainer.num_test_episodes=2", "trainer.test_batch_episodes=2",
        *overrides, trainer=trainer,
    )


def test_the_chat_view_renders_each_agents_prompt_through_its_template(cache, text_folder):
    scenario = build_scenario(rl_config(
        cache, text_folder, "protocol.max_rounds=3", "protocol.first_speaker=verifier", "scenario.default_agent.max_new_tokens=20"
    ))
    env = scenario.make_env(3, "train", 0, "cpu")
    check_env_specs(env)
    tokenizer = scenario.chat_speakers[0].tokenizer
    state = env.reset()
    program = scenario.split("train").programs[int(state["state", "list_index"][0])]
    verifier = scenario.protocol.verifier_index
    text = tokenizer.decode(state["agents", "prompt_ids"][0, verifier][state["agents", "prompt_mask"][0, verifier]])
    assert text.startswith("<bos><|system|>Your task is to decide") and program.source.rstrip() in text
    assert LAST_TURN_NOTICE not in text  # the verifier's first turn of three
    # The verifier asks, the prover answers; on its last turn the verifier reads both, with the notice to decide.
    for words in (["", "Question: why?"], ["It is right.", ""], ["", "Decision: accept"]):
        action = torch.full((3, 2, env.reply_tokens), tokenizer.pad_token_id)
        for agent, reply in enumerate(words):
            ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            action[:, agent, : len(ids)] = torch.tensor(ids)
        state["agents", "action"] = action
        state = env.step(state)
        if not bool(state["next", "done"].any()):
            text = tokenizer.decode(state["next", "agents", "prompt_ids"][0, verifier], skip_special_tokens=False)
        state = step_mdp(state)
    assert "verifier: Question: why?\nprover: It is right." in text and LAST_TURN_NOTICE in text
    assert state["state", "decision"].tolist() == [1, 1, 1]


@pytest.mark.slow
def test_one_rl_iteration_trains_chat_view_agents_with_lora_and_masks_exactly_the_replies(cache, text_folder, tmp_path):
    run = rl_config(cache, text_folder, "scenario.default_agent.lora.r=4", "scenario.default_agent.lora.target_modules=[q_proj,v_proj]")
    trainer = experiment.build_trainer(run, tmp_path / "run")
    policy = trainer.policy.policy("verifier")
    trainable = {name for name, param in policy.named_parameters() if param.requires_grad}
    assert trainable and all("lora_" in name or name.startswith("value_head") for name in trainable)
    before = {name: param.detach().clone() for name, param in policy.named_parameters()}
    batch = next(trainer._collector_iterator)
    mask, action, active = batch[keys.TOKEN_MASK_KEY], batch[keys.ACTION_KEY], batch[keys.ACTIVE_KEY]
    lengths = trainer.train_env.reply_lengths(action.reshape(-1, 2, action.shape[-1])).reshape(active.shape)
    eos = torch.tensor([speaker.eos_id for speaker in trainer.scenario.chat_speakers])
    ended = ((action == eos.view(-1, 1)) & mask).any(-1)
    expected = torch.arange(action.shape[-1]) < (lengths + ended.long()).unsqueeze(-1)
    assert bool((mask == (expected & active.unsqueeze(-1))).all())
    metrics = trainer.train()
    assert {"test/accuracy", "test/decided", "test/episode_length"} <= set(metrics)
    changed = {name for name, param in policy.named_parameters() if not torch.equal(param, before[name])}
    assert changed and changed <= trainable


@pytest.mark.slow
@pytest.mark.parametrize("trainer", fast_trainers(RL_TRAINERS))
def test_every_rl_objective_trains_chat_view_agents_with_lora(cache, text_folder, tmp_path, trainer):
    # Every standard objective and one learning-aware trainer: the learning-aware ones differ from each other in
    # their update, not in what they ask of the game, and each trains chat-view LM agents with LoRA in
    # tests/test_lm_chat.py (2 to 10 times PPO's time here, for the second-order terms through the adapters).
    run = rl_config(
        cache, text_folder, "scenario.default_agent.lora.r=4", "scenario.default_agent.lora.target_modules=[q_proj,v_proj]",
        "scenario.default_agent.temperature=2", "trainer.group_size=2", trainer=trainer,
    )
    metrics = experiment.build_trainer(run, tmp_path / "run").train()
    assert "test/accuracy" in metrics


@pytest.mark.parametrize("preset", ["code_validation_text", "code_validation_chat"])
def test_the_presets_compose_and_pass_the_checks(preset):
    checked = preflight(make_config(f"preset={preset}"))
    protocol = checked.scenario.protocol
    assert checked.scenario.config.name == "code_validation" and protocol.name == "nip"
    assert protocol.num_rounds == 2 and protocol.agent_names[int(protocol.active_agents(torch.tensor(0)).float().argmax())] == "prover"


# ------------------------------------------------------------------ the chat view's warm start
def demo_config(cache: Path, folder: Path, *overrides: str):
    """The chat view on the character-level folder, with replies long enough for every scripted sentence."""
    return rl_config(
        cache, folder, *PROTOCOLS["nip_verifier_asks_first"], "protocol.first_speaker=verifier",
        "scenario.default_agent.max_new_tokens=160",
        "scenario.quote_tokens=24", *overrides,
    )


def reply_text(speaker, tokens: torch.Tensor, mask: torch.Tensor) -> str:
    """A demonstrated reply's text: its tokens under the mask, before the eos token."""
    ids = tokens[mask].tolist()
    assert ids[-1] == speaker.eos_id and speaker.eos_id not in ids[:-1]
    return speaker.tokenizer.decode(ids[:-1], skip_special_tokens=True)


def test_the_chat_views_demonstrations_replay_the_scripted_play(cache, text_folder):
    from nip_like.warm_start import ALL_AGENTS, pretrained_agent_names

    scenario = build_scenario(demo_config(cache, text_folder))
    assert pretrained_agent_names(scenario, [ALL_AGENTS]) == ["prover", "verifier"] == scenario.demonstration_agents()
    demos = scenario.demonstrations("train", seed=0)
    split, texts = scenario.split("train"), scenario.datapoint_texts("train")
    count = len(split.programs)
    verifier, prover = (scenario.agent_names.index(name) for name in ("verifier", "prover"))
    speakers = scenario.chat_speakers
    # The verifier asks (round 0), the prover answers (round 1), the verifier decides (round 2): each
    # agent's rows in the order of the rounds, then of the programs of the split, every one played once.
    assert demos["verifier"].batch_size[0] == 2 * count and demos["prover"].batch_size[0] == count
    for name, data in demos.items():
        mask = data["token_mask"]
        lengths = mask.sum(-1)
        # The mask covers the reply and its eos token, from the first position on, and nothing after.
        assert torch.equal(mask, torch.arange(mask.shape[-1]) < lengths.unsqueeze(-1))
        speaker = speakers[scenario.agent_names.index(name)]
        assert bool((data["tokens"][~mask] == speaker.pad_id).all())
    question, answer, decision = demos["verifier"][:count], demos["prover"], demos["verifier"][count:]
    for program in range(count):
        asked = reply_text(speakers[verifier], question["tokens"][program], question["token_mask"][program])
        said = reply_text(speakers[prover], answer["tokens"][program], answer["token_mask"][program])
        decided = reply_text(speakers[verifier], decision["tokens"][program], decision["token_mask"][program])
        assert parse_reply(asked, True) == "message" and parse_reply(said, False) == "message"
        assert parse_reply(decided, True) == ("accept" if bool(split.label[program]) else "reject")
        # The last turn's prompt: the verifier's last-turn chat on this program, quoting the demonstrated tokens.
        quotes = [
            (sender, data["tokens"][program][data["token_mask"][program]][: int(scenario.config.quote_tokens)].tolist())
            for sender, data in (("verifier", question), ("prover", answer))
        ]
        expected = scenario.last_turn_speaker.render(texts[program], quotes)
        prompt = decision["prompt_ids"][program][decision["prompt_mask"][program]].tolist()
        assert prompt == expected and bool(decision["prompt_mask"][program, -len(expected):].all())
    # Every prompt is the one the environment gives the policy: step the demonstrated replies through it.
    env = scenario.make_env(count, "train", 0, "cpu")
    state = env.reset()
    state["state", "list_index"] = torch.arange(count)
    state["state", "label"] = split.label.clone()
    state.update({("agents", key): value for key, value in env.policy_inputs(state["state"]).items()})
    turns = [{verifier: question}, {prover: answer}, {verifier: decision}]
    for turn in turns:
        action = torch.full((count, 2, env.reply_tokens), speakers[0].pad_id)
        for agent, data in turn.items():
            assert torch.equal(state["agents", "prompt_ids"][:, agent], data["prompt_ids"])
            assert torch.equal(state["agents", "prompt_mask"][:, agent], data["prompt_mask"])
            action[:, agent] = data["tokens"]
        state["agents", "action"] = action
        state = step_mdp(env.step(state))
    # The demonstrated decisions are the labels', and they end every episode.
    assert state["done"].all() and torch.equal(state["state", "decision"], split.label.long())


def test_a_scripted_reply_longer_than_max_new_tokens_is_refused_in_one_line(cache, text_folder):
    scenario = build_scenario(demo_config(cache, text_folder, "scenario.default_agent.max_new_tokens=40"))
    with pytest.raises(ConfigError, match=(
        r"^agent verifier's scripted reply has \d+ tokens, more than its max_new_tokens \(40\): "
        r"raise scenario.default_agent.max_new_tokens to at least \d+[^\n]*$"
    )):
        scenario.demonstrations("train")


@pytest.mark.slow
def test_the_warm_started_chat_preset_makes_the_verifier_decide(cache, tmp_path):
    run = make_config(
        "preset=code_validation_chat", f"scenario.cache_dir={cache}", *DATA, "run.progress_bar=false",
        f"trainer.pretrain.cache_dir={tmp_path / 'pretrained'}", "trainer.pretrain.epochs=30",
        "trainer.num_iterations=1", "trainer.eval.every=0", "trainer.num_test_episodes=16", "trainer.test_batch_episodes=16",
    )
    metrics = run_experiment(run, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # Both agents were fitted to the scripted play in this run; the verifier then decides (random weights never do).
    scalars = tmp_path / "run" / "metrics" / "scalars" / "pretrain"
    assert {path.name for path in scalars.iterdir()} == {"prover", "verifier"}
    assert summary["test_metrics"]["test/decided"] == metrics["test/decided"] >= 0.9


def test_the_solo_agent_trainer_fits_the_solo_verifier_to_its_demonstrations(cache, text_folder, tmp_path):
    # The supervised baseline: the verifier reads the program and writes its decision, fitted to the scripted one.
    run = config(
        cache, "protocol=solo_verifier", f"scenario.default_agent.pretrained_path={text_folder}",
        "scenario.default_agent.max_new_tokens=24", "logger=none", "trainer.num_iterations=1", "trainer.minibatch_size=8",
        trainer="solo_agent",
    )
    trainer = experiment.build_trainer(run, tmp_path / "run")
    assert set(trainer.data("train").keys()) == {"prompt_ids", "prompt_mask", "tokens", "token_mask"}
    metrics = trainer.train()
    assert 0.0 <= metrics["test/accuracy"] <= 1.0 and metrics["test/token_loss"] > 0


# ------------------------------------------------------------------ the protocol comparison, end to end
def _fitting_protocols(preset: str) -> list[str]:
    """Every registered protocol that the code-validation task accepts (its checks pass), by the registry."""
    fitting = []
    for name in REGISTERED_PROTOCOLS.names():
        try:
            validate(make_config(f"preset={preset}", f"protocol={name}"))
        except ConfigError:
            continue
        fitting.append(name)
    return fitting


@pytest.mark.slow  # a few dozen compositions: seconds
@pytest.mark.parametrize(("sweep", "preset"), [
    ("code_validation_protocols", "code_validation_chat"), ("code_validation_protocols_text", "code_validation_text"),
])
def test_the_protocol_sweeps_cover_every_fitting_protocol_on_three_seeds(sweep, preset):
    jobs = expand_sweep(sweep, out=Path("/tmp/unused")).jobs
    assert all(job.error is None for job in jobs), [job.error for job in jobs if job.error]
    protocols = _fitting_protocols(preset)
    assert len(protocols) == 6  # the NIP paper's six on this task
    assert sorted(job.name for job in jobs) == sorted(f"protocol={p},seed={s}" for p in protocols for s in (0, 1, 2))


@pytest.mark.slow
def test_the_protocol_sweep_runs_at_smoke_size_and_the_report_tables_both_measures(cache, tmp_path):
    # The sweep's own config (preset, test rollouts), two protocols and two seeds, each job one iteration after a
    # one-epoch warm start on the small dataset; then the comparison report, one row per protocol.
    smoke = [
        f"scenario.cache_dir={cache}", *DATA, "run.test_run=true", "trainer.pretrain.epochs=1",
        f"trainer.pretrain.cache_dir={tmp_path / 'pretrained'}", "logger=csv",
    ]
    sweep = expand_sweep("code_validation_protocols", ["protocol=nip,solo_verifier", "seed=0,1", *smoke], out=tmp_path / "sweep")
    assert len(sweep.jobs) == 4
    for job in sweep.jobs:
        run_experiment(compose_config(job.overrides), job.folder)
    with script_module("compare_objectives") as report:
        status = report.main([
            str(sweep.root), "--objective-key", "protocol.name", "--task-key", "scenario.name",
            "--metrics", "test/accuracy,test/always_wrong", "--primary-metric", "test/accuracy",
            "--curve-metric", "eval/accuracy", "--no-plots", "--reps", "200", "--out", str(tmp_path / "report"),
            # Test-run mode sizes each protocol's batch by its own episode length (one episode per environment),
            # so the smoke-size runs have unequal frame budgets by design; the matched-budget check is tested elsewhere.
            "--allow-mixed-budgets",
        ])
    assert status == 0
    rows = (tmp_path / "report" / "final_metrics.csv").read_text().splitlines()
    for protocol in ("nip", "solo_verifier"):
        for metric in ("test/accuracy", "test/always_wrong"):
            assert any(protocol in row and metric in row for row in rows), rows
