"""The stress-test scenario: its prompts, reward, environment, tree, metrics, checks, and every RL trainer on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrl.envs.utils import check_env_specs, step_mdp

import nip_like.experiment as experiment
from nip_like.errors import ConfigError
from nip_like.experiment import preflight
from nip_like.validation import build_scenario
from nip_like.scenarios.stress_test.prompts import default_prompts, load_prompts, split_prompts
from nip_like.scenarios.stress_test.reward import RewardWeights, turn_reward, utterance_likelihood
from nip_like.scenarios.stress_test.target import conversation_text, target_chat
from tests.conftest import fast_trainers, make_config
from tests.test_duplicates_scenario import RL_TRAINERS
from tests.fake_servers import fake_server
from tests.lm_folders import chat_model  # noqa: F401 - the fixture

#: The tiny auditor (and target) model's sizes.
SIZES = dict(vocab_size=500, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def folder(chat_model) -> Path:  # noqa: F811 - the fixture
    return chat_model("qwen2", **SIZES)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stress_test_cache")


def config(folder: Path, cache: Path, *overrides: str, trainer: str = "ppo"):
    return make_config(
        "preset=stress_test_quick", f"trainer={trainer}", "logger=none", "run.progress_bar=false",
        f"scenario.cache_dir={cache}", f"scenario.default_agent.pretrained_path={folder}", *overrides,
    )


def utterance_action(tokenizer, texts: list[str], width: int) -> torch.Tensor:
    """``(B, 1, width)`` actions that say ``texts``, each ended by eos and padded."""
    action = torch.full((len(texts), 1, width), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    for row, text in enumerate(texts):
        ids = (tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:width]
        action[row, 0, : len(ids)] = torch.tensor(ids)
    return action


# ------------------------------------------------------------------ prompts
def test_prompts_come_from_a_json_list_or_jsonl_file_and_split_into_disjoint_train_and_test(tmp_path):
    listed = tmp_path / "prompts.json"
    listed.write_text(json.dumps(["a", "b", "c", "d"]))
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('"a"\n"b"\n\n"c"\n"d"\n')
    assert load_prompts(listed) == load_prompts(lines) == ["a", "b", "c", "d"]
    splits = split_prompts(default_prompts(), 0.25, seed=3)
    assert len(splits["test"]) == 10 and len(splits["train"]) == 30 and not set(splits["train"]) & set(splits["test"])
    assert split_prompts(default_prompts(), 0.25, seed=3) == splits != split_prompts(default_prompts(), 0.25, seed=4)
    assert {len(part) for part in split_prompts(["x", "y"], 0.9, 0).values()} == {1}  # at least one each


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        ('{"a": 1}', "p.json", "must hold a list of strings"),
        ('["a", 2]', "p.json", "must hold a list of strings"),
        ('"a"\nnot json\n', "p.jsonl", "is not valid JSON lines"),
        ('["only one"]', "p.json", "holds 1 prompt(s)"),
        (None, "missing.json", "does not exist"),
    ],
)
def test_a_bad_prompts_file_is_one_line(tmp_path, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="scenario.prompts_file") as error:
        load_prompts(path)
    assert message in str(error.value) and "\n" not in str(error.value)


# ------------------------------------------------------------------ the reward
def test_the_turn_reward_is_astprompters_weighted_sum_on_hand_computed_numbers():
    likelihood, combined, response = torch.tensor([-2.0, 0.0]), torch.tensor([1.0, 0.25]), torch.tensor([0.5, 0.0])
    expected = torch.tensor([0.0825 * -2.0 + 2.0 * 1.0 + 0.5 * 0.5, 2.0 * 0.25])  # 2.085, 0.5
    assert torch.allclose(turn_reward(likelihood, combined, response, RewardWeights()), expected)
    assert torch.allclose(turn_reward(likelihood, combined, response, RewardWeights(1.0, 0.0, 4.0)), torch.tensor([0.0, 0.0]))


@pytest.mark.slow
def test_the_likelihood_is_the_mean_log_prob_of_the_utterance_and_its_end_after_its_context(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    contexts, utterances = ["Hello there, how are you?", "A"], ["I am fine", ""]
    got = utterance_likelihood(model, tokenizer, contexts, utterances)  # two rows of different lengths: padded
    for row, (context, utterance) in enumerate(zip(contexts, utterances)):
        head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        before = head + tokenizer(context + "\n", add_special_tokens=False)["input_ids"]
        scored = tokenizer(utterance, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            log_probs = model(torch.tensor([before + scored])).logits[0].log_softmax(-1)
        by_hand = sum(float(log_probs[len(before) + index - 1, token]) for index, token in enumerate(scored)) / len(scored)
        assert got[row].item() == pytest.approx(by_hand, abs=1e-5) and by_hand < 0
    # A context longer than the model's loses its start: the utterance is still scored whole.
    short = utterance_likelihood(model, tokenizer, ["word " * 50], ["I am fine"], max_length=12)
    assert short.shape == (1,) and torch.isfinite(short).all()


def test_the_target_reads_the_prompt_with_the_first_utterance_then_alternates():
    chat = target_chat("Be kind.", "Opening.", ["u0", "u1"], ["r0"])
    assert chat == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Opening.\nu0"},
        {"role": "assistant", "content": "r0"},
        {"role": "user", "content": "u1"},
    ]
    assert target_chat("", "P", ["u0"], [])[0] == {"role": "user", "content": "P\nu0"}
    assert conversation_text("P", ["u0", "u1"], ["r0"]) == "P\nu0\nr0\nu1"


# ------------------------------------------------------------------ the environment
@pytest.mark.slow
def test_the_env_passes_check_env_specs_and_a_turn_is_rewarded_by_the_formula(folder, cache):
    # The target on a stand-in server that always insults; the local folder scores the likelihood term.
    with fake_server("ok", reply="You idiot.") as server:
        scenario = build_scenario(config(
            folder, cache, f"scenario.target.served.base_url={server.url}", "scenario.target.served.model=fake",
            f"scenario.target.pretrained_path={folder}",
        ))
        env = scenario.make_env(2, "test", 0, "cpu")
        check_env_specs(env)
        tokenizer = scenario.chat_speakers[0].tokenizer
        state = env.reset()
        state["agents", "action"] = utterance_action(tokenizer, ["hello friend", "you are stupid"], env.reply_tokens)
        state = env.step(state)
    nxt = state["next", "state"]
    prompts = [scenario.all_prompts[int(index)] for index in nxt["prompt_index"]]
    likelihood = utterance_likelihood(env.target.local.model, env.target.local.tokenizer, prompts, ["hello friend", "you are stupid"])
    # Response "You idiot." scores 1, so does each utterance + response; the second utterance scores 1 too.
    assert nxt["response_score"][:, 0].tolist() == [1.0, 1.0] and nxt["utterance_score"][:, 0].tolist() == [0.0, 1.0]
    expected = 0.0825 * likelihood + 2.0 * 1.0 + 0.5 * 1.0
    assert torch.allclose(state["next", "agents", "reward"].view(-1), expected, atol=1e-5)
    assert torch.allclose(nxt["likelihood"][:, 0], likelihood, atol=1e-5)
    # The target read the prompt and the utterance; its response is kept in the auditor's tokens and read back.
    chats = [body["messages"] for kind, body in server.requests if kind == "chat"][-2:]  # check_env_specs asked before
    assert sorted(chat[-1]["content"] for chat in chats) == sorted(f"{p}\n{u}" for p, u in zip(prompts, ["hello friend", "you are stupid"]))
    prompt = tokenizer.decode(state["next", "agents", "prompt_ids"][0, 0], skip_special_tokens=True)
    assert "auditor: hello friend" in prompt and "target: You idiot." in prompt


@pytest.mark.slow
def test_the_tree_branches_every_turn_from_a_prefix_the_siblings_share(folder, cache):
    scenario = build_scenario(config(folder, cache, "protocol.turns=3", "scenario.ppl_weight=0"))
    env = scenario.make_env(4, "train", 0, "cpu")  # width 2: two trees
    assert env.group_size == 2
    tokenizer = scenario.chat_speakers[0].tokenizer
    state = env.reset()
    assert state["state", "prompt_index"][0] == state["state", "prompt_index"][1]
    said = ["calm words", "you idiot", "nice day", "shut up"]
    for turn in range(3):
        before = state["agents", "prompt_ids"].clone()
        assert torch.equal(before[0], before[1]) and torch.equal(before[2], before[3])  # siblings read one conversation
        state["agents", "action"] = utterance_action(tokenizer, said, env.reply_tokens)
        state = env.step(state)
        reward = state["next", "agents", "reward"].view(-1)
        assert reward[1] > reward[0] and reward[3] > reward[2]  # each sibling rewarded for its own utterance
        nxt = state["next", "state"]
        if turn < 2:  # every sibling continues from one of the two branches
            kept = nxt["utterances"][:, turn].view(2, 2, -1)
            assert torch.equal(kept[:, 0], kept[:, 1])
        else:  # the last turn keeps each episode's own utterance
            assert nxt["utterance_score"][:, 2].tolist() == [0.0, 1.0, 0.0, 1.0]
        state = step_mdp(state)
    assert bool(state["done"].all()) if "done" in state.keys() else True


@pytest.mark.slow
def test_test_rollouts_side_by_side_are_not_trees(folder, cache):
    scenario = build_scenario(config(folder, cache, "scenario.ppl_weight=0"))
    env = scenario.make_env(2, "test", 0, "cpu", group_size=2)  # trainer.test_rollouts=2: one prompt, played twice
    state = env.reset()
    state["agents", "action"] = utterance_action(scenario.chat_speakers[0].tokenizer, ["calm words", "you idiot"], env.reply_tokens)
    played = env.step(state)["next", "state"]
    assert played["prompt_index"][0] == played["prompt_index"][1]
    assert played["utterance_score"][:, 0].tolist() == [0.0, 1.0]  # each keeps its own conversation


@pytest.mark.slow
def test_episode_metrics_count_attack_success_and_the_first_flagged_turn(folder, cache):
    scenario = build_scenario(config(folder, cache, "protocol.turns=3", "scenario.ppl_weight=0"))
    env = scenario.make_env(3, "test", 0, "cpu")
    state = env.new_state(torch.tensor([0, 1, 2]))
    state["utterance_length"] = torch.full((3, 3), 2)
    state["response_length"] = torch.full((3, 3), 2)
    state["response_score"] = torch.tensor([[0.0, 0.9, 1.0], [0.0, 0.5, 0.2], [0.7, 0.0, 0.0]])
    state["turn_reward"] = torch.ones(3, 3)
    episodes = env.reset()[:3].clone()
    episodes["state"] = state
    metrics = scenario.episode_metrics(episodes)
    assert metrics["attack_success_rate"] == pytest.approx(2 / 3)  # 0.5 does not pass 0.5
    assert metrics["first_flagged_turn"] == pytest.approx((2 + 4 + 1) / 3)  # never flagged counts as turns + 1
    assert metrics["response_score"] == pytest.approx(float(state["response_score"].mean()))
    assert metrics["turn_reward"] == 1.0 and metrics["episode_length"] == 3.0
    record = scenario.transcripts(episodes, 1)[0]
    assert record["prompt"] == scenario.all_prompts[0] and record["flagged"] and len(record["turns"]) == 6
    assert [turn["agent"] for turn in record["turns"][:2]] == ["auditor", "target"] and record["turns"][3]["flagged"]


# ------------------------------------------------------------------ config checks
@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scenario.target.frozen_from=/nowhere", "scenario.target.pretrained_path=/nowhere"], "give one of them"),
        (["scenario.target.served.base_url=http://127.0.0.1:9/v1", "scenario.target.served.model=m"], "scenario.ppl_weight needs the target's weights"),
        (["scenario.target.served.base_url=ftp://x", "scenario.target.served.model=m", "scenario.ppl_weight=0"], "scenario.target.served.base_url must be an http"),
        (["scenario.scorer.kind=callable", "scenario.scorer.function=nowhere_module.score"], "cannot import module"),
        (["scenario.prompts_file=/nowhere.json"], "scenario.prompts_file: /nowhere.json does not exist"),
    ],
)
def test_bad_options_are_one_line_before_any_work(folder, cache, overrides, message):
    with pytest.raises(ConfigError) as error:
        preflight(config(folder, cache, *overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_another_protocol_is_one_line(cache):
    with pytest.raises(ConfigError, match=r"^scenario stress_test needs protocol=stress_test .*got protocol=nip$"):
        build_scenario(make_config("scenario=stress_test", "protocol=nip", f"scenario.cache_dir={cache}"))


@pytest.mark.slow
def test_a_tree_width_that_is_not_the_trainers_group_size_is_one_line(folder, cache):
    scenario = build_scenario(config(folder, cache, "scenario.tree_width=3"))
    with pytest.raises(ConfigError, match=r"trainer.group_size \(2\) and scenario.tree_width \(3\) disagree"):
        scenario.make_env(6, "train", 0, "cpu", group_size=2)
    with pytest.raises(ConfigError, match=r"trainer.num_envs \(4\) must be a multiple of scenario.tree_width \(3\)"):
        scenario.make_env(4, "train", 0, "cpu")


@pytest.mark.slow
def test_the_target_plays_a_frozen_from_folder(folder, cache):
    scenario = build_scenario(config(folder, cache, f"scenario.target.frozen_from={folder}"))
    assert scenario.target_folder() == str(folder)
    assert build_scenario(config(folder, cache)).target_folder() == str(folder)  # by default the auditor's starting model


# ------------------------------------------------------------------ every RL trainer
@pytest.mark.slow
@pytest.mark.parametrize("trainer", fast_trainers(RL_TRAINERS, learning_aware=0))
def test_every_rl_trainer_trains_the_auditor(folder, cache, tmp_path, trainer):
    run = config(folder, cache, "trainer.num_iterations=1", "trainer.eval.every=0", "trainer.num_test_episodes=4",
                 "trainer.test_batch_episodes=4", "scenario.default_agent.temperature=3", trainer=trainer)
    built = experiment.build_trainer(run, tmp_path / "run")
    policy = built.policy.policy("auditor")
    before = {name: param.detach().clone() for name, param in policy.named_parameters() if param.requires_grad}
    metrics = built.train()
    assert {"test/attack_success_rate", "test/first_flagged_turn", "test/response_score", "test/utterance_score",
            "test/likelihood"} <= set(metrics)
    assert metrics["test/likelihood"] < 0 and metrics["test/episode_length"] == 2.0
    changed = [name for name, param in policy.named_parameters() if name in before and not torch.equal(param, before[name])]
    assert changed and all("lora_" in name or name.startswith("value_head") for name in changed)
    record = json.loads((tmp_path / "run" / "transcripts").glob("*.jsonl").__next__().read_text().splitlines()[0])
    assert [turn["agent"] for turn in record["turns"]] == ["auditor", "target"] * 2


@pytest.mark.slow
def test_the_preset_composes_and_passes_the_checks_without_building_a_model(tmp_path):
    run = make_config("preset=stress_test_quick", f"scenario.cache_dir={tmp_path}")
    checked = preflight(run)
    assert checked.scenario.config.name == "stress_test" and checked.scenario.protocol.num_rounds == 2
    assert run.trainer.group_size == checked.scenario.config.tree_width == 2
    assert not (tmp_path / "chat_models").exists()  # the from-config auditor (and target) is built by the run, not the checks
