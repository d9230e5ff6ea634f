"""Text agents' parts: the chat tokenizer, local text models, the chat scenario, rollouts, fine-tuning, jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nip_like.cli import compose_config
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer
from nip_like.validation import build_scenario
from nip_like.scenarios.decisions import decision_metrics
from nip_like.scenarios.duplicates.chat import ScriptedDuplicatesModel, read_list_line
from nip_like.scenarios.duplicates.chat_text import parse_cells, parse_decision
from nip_like.text.fine_tune import FineTuneSpec, fine_tune
from nip_like.text.interface import Sampling, TextModelConfig
from nip_like.text.models import LocalTextModel, create_model_folder
from nip_like.text.rollouts import load_rollouts, play_episodes, rollout_records, save_rollouts
from nip_like.text.tokenizer import build_chat_tokenizer
from nip_like.validation import validate

TINY_MODEL = TextModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_new_tokens=6)
TURNS = ("protocol.first_speaker=prover", "protocol.min_rounds=1", "protocol.max_rounds=2")


def chat_scenario(*overrides: str):
    config = compose_config(["preset=none", "scenario=duplicates_chat", "scenario.num_lists=400", *overrides])
    return build_scenario(config)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return create_model_folder(TINY_MODEL, tmp_path_factory.mktemp("model") / "tiny", build_chat_tokenizer())


# ------------------------------------------------------------------ tokenizer and models
def test_the_chat_tokenizer_renders_chats_and_round_trips_through_a_folder(tmp_path):
    tokenizer = build_chat_tokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list: 3 ? 7\nprover: 2 0"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|system|>Be brief.<|end|><|user|>list: 3 ? 7\nprover: 2 0<|end|><|assistant|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Be brief.list: 3 ? 7\nprover: 2 0"
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["<bos>", "<|system|>"]
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded(text, add_special_tokens=False)["input_ids"] == ids and reloaded.eos_token == "<|end|>"
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_a_local_model_replies_reproducibly_by_seed_and_greedily(model_folder):
    model = LocalTextModel(model_folder, batch_size=3)
    chats = [[{"role": "user", "content": f"list: {k}"}] for k in range(5)]
    sampled = Sampling(max_new_tokens=6, temperature=1.0)
    first = model.reply(chats, sampled, seed=3)
    assert len(first) == 5 and all(isinstance(reply, str) and len(reply) <= 6 for reply in first)
    assert model.reply(chats, sampled, seed=3) == first
    assert model.reply(chats, sampled, seed=4) != first
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    assert model.reply(chats, greedy, seed=1) == model.reply(chats, greedy, seed=2)
    # Sampling leaves the global random stream alone.
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    model.reply(chats, sampled, seed=5)
    assert torch.equal(torch.rand(1), expected)


def test_a_model_folder_reads_like_any_chat_model(model_folder):
    assert AutoModelForCausalLM.from_pretrained(model_folder, local_files_only=True).config.vocab_size == len(
        build_chat_tokenizer()
    )


def test_a_missing_folder_and_a_tokenizer_without_chat_template_are_one_line_errors(tmp_path, model_folder):
    with pytest.raises(ConfigError, match="does not exist"):
        LocalTextModel(tmp_path / "nowhere")
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    tokenizer.chat_template = None
    bare = tmp_path / "bare"
    AutoModelForCausalLM.from_pretrained(model_folder).save_pretrained(bare)
    tokenizer.save_pretrained(bare)
    with pytest.raises(ConfigError, match="no chat_template"):
        LocalTextModel(bare).reply([[{"role": "user", "content": "hi"}]], Sampling(2), 0)


# ------------------------------------------------------------------ the chat scenario
@pytest.mark.parametrize(
    "text, cells",
    [("3 5", (3, 5)), ("cells 7 and 0.", (7, 0)), ("c2 c2", None), ("9 1", None), ("4", None), ("", None)],
)
def test_replies_name_cells_by_their_first_two_numbers(text, cells):
    assert parse_cells(text, 8) == cells


@pytest.mark.parametrize(
    "text, decision", [("accept", "accept"), ("Reject.", "reject"), (" ACCEPT it", "accept"), ("I accept", None), ("acept", None)]
)
def test_a_decision_is_the_first_word(text, decision):
    assert parse_decision(text) == decision


def test_scripted_honest_play_is_sound_and_the_solo_verifier_is_blind():
    nip = chat_scenario("protocol=nip", *TURNS)
    players = {agent: ScriptedDuplicatesModel(nip.role(agent)) for agent in nip.agent_names}
    sampling = {agent: Sampling(8) for agent in nip.agent_names}
    rollouts = play_episodes(nip, players, sampling, "test", 64, seed=0, by_agent=True)
    assert bool((rollouts["decision"] == rollouts["label"].long()).all())
    records = rollout_records(rollouts, nip.agent_names)
    positive = next(record for record in records if record["label"])
    prover, verifier = positive["turns"]
    assert prover["agent"] == "prover" and prover["move"].startswith("cells")
    assert verifier["chat"][1]["content"].startswith("list: ") and "prover: " in verifier["chat"][1]["content"]
    assert read_list_line(verifier["chat"][1]["content"]).count(None) == 6  # the two named cells are shown
    assert verifier["move"] == "accept" and positive["returns"]["verifier"] == 1.0

    solo = chat_scenario("protocol=solo_verifier")
    blind = play_episodes(solo, {"verifier": ScriptedDuplicatesModel("verifier")}, {"verifier": Sampling(8)}, "test", 64, 0, by_agent=True)
    assert bool((blind["decision"] == 0).all())  # it sees no cell, so never a pair


def test_a_reply_the_verifier_cannot_decide_with_leaves_the_episode_undecided_and_wrong():
    scenario = chat_scenario("protocol=solo_verifier")

    class Mumbler(ScriptedDuplicatesModel):
        def reply(self, chats, sampling, seed):
            return ["maybe" for _ in chats]

    rollouts = play_episodes(scenario, {"verifier": Mumbler("verifier")}, {"verifier": Sampling(8)}, "test", 8, 0, by_agent=True)
    assert bool((rollouts["decision"] == -1).all())
    penalty = scenario.protocol.verifier_incorrect_penalty
    assert bool((rollouts["return"][:, 0] == -penalty).all())
    assert {record["turns"][0]["move"] for record in rollout_records(rollouts, scenario.agent_names)} == {"none"}


def test_rollouts_round_trip_through_their_jsonl_file(tmp_path):
    scenario = chat_scenario("protocol=debate")
    players = {agent: ScriptedDuplicatesModel(scenario.role(agent)) for agent in scenario.agent_names}
    rollouts = play_episodes(scenario, players, {a: Sampling(8) for a in scenario.agent_names}, "train", 12, 5, by_agent=True)
    path = tmp_path / "rollouts.jsonl"
    save_rollouts(rollouts, scenario.agent_names, scenario.protocol.num_rounds, path)
    again = load_rollouts(path)
    assert rollout_records(again, scenario.agent_names) == rollout_records(rollouts, scenario.agent_names)
    for key in ("decision", "label", "list_index", "return", ("turns", "acted"), ("turns", "reward")):
        assert torch.equal(again[key], rollouts[key])
    assert len(path.read_text().splitlines()) == 13  # a header, then one readable episode per line
    assert json.loads(path.read_text().splitlines()[1])["turns"][0]["chat"][0]["role"] == "system"


def test_the_chat_scenario_refuses_tensor_trainers_and_unknown_groups(tmp_path):
    assert not hasattr(chat_scenario("protocol=nip"), "make_agents")  # nothing inherited that it must refuse
    with pytest.raises(ConfigError, match="trainer ppo needs a scenario with agents that are torch modules .TensorGame.; "
                       "scenario 'duplicates_chat' has none; trainers for it: expert_iteration, malt"):
        build_trainer(compose_config(["preset=none", "scenario=duplicates_chat", "protocol=nip", "trainer=ppo"]), tmp_path)
    with pytest.raises(ConfigError, match="scenario duplicates_chat needs an interactive-proof protocol"):
        chat_scenario("protocol=prover_verifier")
    with pytest.raises(ConfigError, match="agent_groups names"):
        chat_scenario("protocol=nip", "+scenario.agent_groups.judge=shared")
    shared = chat_scenario("protocol=nip", "+scenario.agent_groups.prover=shared", "+scenario.agent_groups.verifier=shared")
    assert shared.group_names() == ["shared"]


# ------------------------------------------------------------------ fine-tuning
def sft_records(count: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"list: {k % 3}"}, {"role": "assistant", "content": "accept" if k % 3 else "reject"}]}
        for k in range(count)
    ]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_sft_learns_the_assistant_replies_only(tmp_path, model_folder):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(48))
    steps = []
    spec = FineTuneSpec("sft", "sft", str(model_folder), str(data), str(tmp_path / "out"), epochs=80, lr=3e-3, batch_size=16)
    output = fine_tune(spec, steps.append)
    assert steps[-1]["loss"] < 0.2 * steps[0]["loss"]
    # Counted tokens are the replies and their end token: 7 characters each.
    assert steps[0]["num_tokens"] == 16 * 7
    model = LocalTextModel(output)
    replies = model.reply([[{"role": "user", "content": f"list: {k}"}] for k in range(3)], Sampling(8, 0.0), 0)
    assert replies == ["reject", "accept", "accept"]


def test_dpo_moves_towards_the_chosen_replies_with_trls_metric_names(tmp_path, model_folder):
    records = [
        {
            "prompt": [{"role": "user", "content": f"list: {k}"}],
            "chosen": [{"role": "assistant", "content": "accept"}],
            "rejected": [{"role": "assistant", "content": "reject"}],
        }
        for k in range(32)
    ]
    data = write_jsonl(tmp_path / "dpo.jsonl", records)
    steps = []
    spec = FineTuneSpec("dpo", "dpo", str(model_folder), str(data), str(tmp_path / "out"), epochs=20, lr=1e-3, batch_size=16)
    fine_tune(spec, steps.append)
    names = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"}
    assert names <= set(steps[0])
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as its reference
    assert steps[-1]["rewards/margins"] > 0.5 and steps[-1]["rewards/accuracies"] == 1.0


def test_a_bad_dataset_line_is_named(tmp_path, model_folder):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(sft_records(1)[0]) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not JSON"):
        fine_tune(FineTuneSpec("x", "sft", str(model_folder), str(data), str(tmp_path / "out")))
    data.write_text(json.dumps({"prompt": []}) + "\n")
    with pytest.raises(ConfigError, match="missing chosen, rejected"):
        fine_tune(FineTuneSpec("x", "dpo", str(model_folder), str(data), str(tmp_path / "out")))


def test_a_tree_of_replies_shares_each_node_among_its_leaves():
    scenario = chat_scenario("protocol=nip", *TURNS)
    players = {agent: ScriptedDuplicatesModel(scenario.role(agent)) for agent in scenario.agent_names}
    trees = play_episodes(scenario, players, {a: Sampling(8) for a in scenario.agent_names}, "train", 6, 2, by_agent=True, branching=3)
    assert trees.batch_size[0] == 6 * 9
    records = rollout_records(trees, scenario.agent_names)
    for tree in range(6):
        leaves = records[tree * 9 : (tree + 1) * 9]
        assert len({record["list_index"] for record in leaves}) == 1
        # Round 0 (the prover): one reply per block of 3 leaves; round 1 (the verifier): one per leaf.
        provers = [leaf["turns"][0]["reply"] for leaf in leaves]
        assert all(provers[i] == provers[i - i % 3] for i in range(9))
    # Decoys are random, so the prover's 3 siblings differ somewhere.
    assert any(len({records[t * 9 + 3 * b]["turns"][0]["reply"] for b in range(3)}) > 1 for t in range(6))


def test_test_rollouts_play_each_list_side_by_side_and_count_the_lists_always_decided_wrong(model_folder):
    scenario = chat_scenario("protocol=solo_verifier")
    model = LocalTextModel(model_folder, batch_size=16)
    sampled = {"verifier": Sampling(max_new_tokens=6, temperature=1.0)}
    rollouts = play_episodes(scenario, {"verifier": model}, sampled, "test", 16, seed=0, group_size=4)
    index = rollouts["list_index"].view(4, 4)
    assert bool((index == index[:, :1]).all()) and len(set(index[:, 0].tolist())) > 1
    replies = [record["turns"][0]["reply"] for record in rollout_records(rollouts, scenario.agent_names)]
    assert any(len(set(replies[block * 4 : block * 4 + 4])) > 1 for block in range(4))  # sampled, not repeated
    metrics = decision_metrics(rollouts["decision"], rollouts["label"], rollouts["list_index"])
    assert metrics["episodes_per_datapoint"] == 4.0
    wrong = (rollouts["decision"] != rollouts["label"].long()).view(4, 4).all(-1).float().mean().item()
    assert metrics["always_wrong"] == pytest.approx(wrong)
    with pytest.raises(ValueError, match="multiple of group_size"):
        play_episodes(scenario, {"verifier": model}, sampled, "test", 6, seed=0, group_size=4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.test_rollouts=4"], r"trainer.test_rollouts \(4\) plays each test datapoint several times.*test_greedy=false"),
        (["trainer.test_rollouts=3", "trainer.test_greedy=false", "trainer.test_episodes=64"], r"trainer.test_episodes \(64\) must be a multiple of trainer.test_rollouts \(3\)"),
    ],
)
def test_text_test_rollouts_need_sampled_tests_and_a_multiple_of_episodes(overrides, message):
    config = compose_config(["preset=text_quick", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(config)
