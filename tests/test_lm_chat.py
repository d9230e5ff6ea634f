"""Language-model agents at a realistic shape: chat model folders, the chat view, pad = eos, stop strings,
micro-batches by a token budget, LoRA through peft, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrl.envs.utils import check_env_specs
from transformers import AutoModelForCausalLM, AutoTokenizer

import nip_like.experiment as experiment
from nip_like import keys
from nip_like.checkpoint import load_checked
from nip_like.errors import ConfigError
from nip_like.export import main as export_main
from nip_like.lm.lora import LoraOptions
from nip_like.lm.models import LMAgentConfig, build_lm_policy
from nip_like.lm.policy import LMPolicy, micro_batches
from nip_like.registry import TRAINERS
from nip_like.validation import build_scenario
from nip_like.scenarios.duplicates.chat_view import ChatSpeaker, DuplicatesChatViewEnv, list_line, parse_reply
from nip_like.scenarios.duplicates.chat_text import read_list_line
from nip_like.trainers.learning_aware import LearningAwareTrainer
from tests.conftest import make_config
from tests.lm_folders import FAMILIES, chat_model  # noqa: F401 - the fixture
from tests.test_duplicates_scenario import RL_TRAINERS


def chat_config(folder: Path, tmp_path: Path, *overrides: str):
    """A tiny duplicates game in the chat view, every agent from ``folder``."""
    return make_config(
        "scenario=duplicates",
        "protocol=nip",
        "protocol.first_speaker=prover",
        "protocol.max_rounds=2",
        "scenario.view=chat",
        *([f"scenario.default_agent.pretrained_path={folder}"] if folder is not None else []),
        "scenario.default_agent.max_new_tokens=12",
        "scenario.num_lists=60",
        "scenario.length=6",
        "scenario.num_values=12",
        f"scenario.cache_dir={tmp_path / 'cache'}",
        "trainer.num_envs=4",
        "trainer.frames_per_batch=16",
        "trainer.minibatch_size=8",
        "trainer.num_iterations=1",
        "trainer.eval.every=0",
        "trainer.num_test_episodes=4",
        "trainer.test_batch_episodes=4",
        "run.progress_bar=false",
        "run.num_threads=1",
        "logger=none",
        *overrides,
    )


def policy_of(folder: Path, **options):
    return build_lm_policy(LMAgentConfig(pretrained_path=str(folder), **options))


# ------------------------------------------------------------------ the model folders
@pytest.mark.parametrize("family", FAMILIES)
def test_a_built_folder_looks_like_a_download_and_loads_through_the_user_path(chat_model, family):
    folder = chat_model(family)
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tokenizer) == 1000  # a trained byte-level BPE vocabulary, not a word list
    assert tokenizer.chat_template
    assert (tokenizer.pad_token_id == tokenizer.eos_token_id) == (family in ("llama", "gpt2"))
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert model.config.model_type == family
    text = tokenizer.apply_chat_template([{"role": "user", "content": "list: 3 ? 7"}], tokenize=False, add_generation_prompt=True)
    assert "list: 3 ? 7" in text and text != "list: 3 ? 7"


# ------------------------------------------------------------------ sampling and scoring
def test_with_pad_equal_to_eos_a_message_keeps_its_eos_and_masks_nothing_after_it(chat_model):
    policy = policy_of(chat_model("llama"), max_new_tokens=24)
    assert policy.pad_token_id == policy.eos_token_id
    # Few tokens allowed besides eos, so that most messages end within 24 tokens and some do not.
    policy.banned[:] = True
    policy.banned[300:330] = False
    policy.banned[policy.eos_token_id] = False
    prompts = torch.randint(300, 900, (32, 7))
    sample = policy.sample(prompts, torch.ones_like(prompts, dtype=torch.bool), torch.Generator().manual_seed(0))
    mask, tokens = sample["token_mask"], sample["tokens"]
    lengths = mask.sum(-1)
    assert bool((mask == (torch.arange(24) < lengths.unsqueeze(-1))).all())  # a prefix of each row
    ended = sample["finished"]
    assert bool(ended.any()) and bool((~ended).any())
    last = tokens.gather(-1, (lengths - 1).unsqueeze(-1)).squeeze(-1)
    assert bool((last[ended] == policy.eos_token_id).all())  # the eos itself is a masked-in token
    assert bool(((tokens == policy.eos_token_id) & mask).sum(-1).le(1).all())
    scored, _ = policy.log_probs(prompts, torch.ones_like(prompts, dtype=torch.bool), tokens, mask)
    torch.testing.assert_close(scored, sample["token_log_probs"], atol=1e-5, rtol=1e-5)


def test_a_stop_string_ends_the_message_after_the_token_that_completes_it(chat_model):
    folder = chat_model("qwen2")
    prompts = torch.randint(300, 900, (4, 6))
    mask = torch.ones_like(prompts, dtype=torch.bool)
    free = policy_of(folder, max_new_tokens=10).sample(prompts, mask, greedy=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    stop = tokenizer.decode(free["tokens"][0, 3:5])
    assert stop.strip()
    stopped = policy_of(folder, max_new_tokens=10, stop_strings=[stop]).sample(prompts, mask, greedy=True)
    length = int(stopped["token_mask"][0].sum())
    assert length <= 5 and stop in tokenizer.decode(stopped["tokens"][0, :length])
    assert bool(stopped["finished"][0])
    torch.testing.assert_close(stopped["tokens"][0, :length], free["tokens"][0, :length])


def test_extra_left_padding_changes_no_score(chat_model):
    policy = policy_of(chat_model("gpt2"), max_new_tokens=6)
    prompts = torch.randint(300, 900, (3, 5))
    tokens = torch.randint(300, 900, (3, 6))
    token_mask = torch.arange(6) < torch.tensor([[6], [2], [4]])
    plain = policy.evaluate(prompts, torch.ones_like(prompts, dtype=torch.bool), tokens, token_mask)
    padded_ids = torch.cat([torch.full((3, 9), policy.pad_token_id), prompts], -1)
    padded_mask = torch.cat([torch.zeros(3, 9, dtype=torch.bool), torch.ones(3, 5, dtype=torch.bool)], -1)
    padded = policy.evaluate(padded_ids, padded_mask, tokens, token_mask)
    for name in ("token_log_probs", "entropy", "value"):
        torch.testing.assert_close(plain[name], padded[name], atol=1e-5, rtol=1e-5)


def test_micro_batches_by_a_token_budget_give_the_one_pass_gradient(chat_model):
    folder = chat_model("qwen2")
    torch.manual_seed(0)
    rows = 12
    prompt_lengths = torch.randint(3, 20, (rows,))
    prompt_mask = torch.arange(20) >= 20 - prompt_lengths.unsqueeze(-1)
    prompts = torch.where(prompt_mask, torch.randint(300, 900, (rows, 20)), 0)
    tokens = torch.randint(300, 900, (rows, 16))
    token_mask = torch.arange(16) < torch.randint(1, 17, (rows, 1))
    weights = torch.randn(rows, 16)
    results = {}
    for budget in (None, 40):
        torch.manual_seed(1)  # the same value head
        policy = policy_of(folder, max_new_tokens=16, max_tokens_per_micro_batch=budget)
        scored = policy.evaluate(prompts, prompt_mask, tokens, token_mask)
        loss = (scored["token_log_probs"] * weights).sum() + scored["value"].square().sum() + scored["entropy"].mean()
        loss.backward()
        grads = {name: param.grad.clone() for name, param in policy.named_parameters() if param.grad is not None}
        results[budget] = (scored, grads, policy.pop_padding_counts())
    (one, grads_one, counts_one), (split, grads_split, counts_split) = results[None], results[40]
    for name in ("token_log_probs", "entropy", "value"):
        torch.testing.assert_close(one[name], split[name], atol=1e-5, rtol=1e-4)
    assert grads_one.keys() == grads_split.keys() and grads_one
    for name in grads_one:
        torch.testing.assert_close(grads_one[name], grads_split[name], atol=1e-5, rtol=1e-4)
    # Same real tokens, less padding when rows of similar length share a pass.
    assert counts_one[0] == counts_split[0] == int(prompt_lengths.sum() + token_mask.sum())
    assert counts_split[1] < counts_one[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_scoring_in_chunks_gives_the_one_pass_scores_and_gradient(chat_model, family):
    folder = chat_model(family)
    torch.manual_seed(0)
    prompts = torch.randint(300, 900, (5, 9))
    mask = torch.ones_like(prompts, dtype=torch.bool)
    tokens = torch.randint(300, 900, (5, 7))
    token_mask = torch.arange(7) < torch.randint(1, 8, (5, 1))
    weights = torch.randn(5, 7)
    results = []
    for chunk in (0, 3, None):  # all logits at once; chunks of 3, 3 and 1 positions; automatic (the default)
        torch.manual_seed(1)  # the same value head
        policy = policy_of(folder, max_new_tokens=7, score_chunk_tokens=chunk, lora=LoraOptions(r=4))
        scored = policy.evaluate(prompts, mask, tokens, token_mask)
        ((scored["token_log_probs"] * weights).sum() + scored["entropy"].mean() + scored["value"].sum()).backward()
        results.append((scored, {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}))
    (whole, grads_whole), *others = results
    for chunked, grads_chunked in others:
        for name in ("token_log_probs", "entropy", "value"):
            torch.testing.assert_close(whole[name], chunked[name], atol=1e-5, rtol=1e-4)
        assert grads_whole.keys() == grads_chunked.keys() and any("lora" in name for name in grads_whole)
        for name in grads_whole:
            torch.testing.assert_close(grads_whole[name], grads_chunked[name], atol=1e-5, rtol=1e-4, msg=name)


def test_automatic_chunks_score_with_gradients_or_large_logits_and_bound_a_chunks_logits(chat_model, monkeypatch):
    import nip_like.lm.teacher_forcing as scoring

    policy = policy_of(chat_model("qwen2"), max_new_tokens=7)
    prompts, mask = torch.randint(300, 900, (5, 9)), torch.ones(5, 9, dtype=torch.bool)
    tokens, token_mask = torch.randint(300, 900, (5, 7)), torch.ones(5, 7, dtype=torch.bool)
    chunks = []
    real = scoring.chunked_scores
    monkeypatch.setattr(scoring, "chunked_scores", lambda head, hidden, tokens, size, *rest: chunks.append(size) or real(head, hidden, tokens, size, *rest))
    with torch.no_grad():  # without gradients, logits within one chunk's bytes are taken whole: no chunks
        whole = policy.evaluate(prompts, mask, tokens, token_mask)
    assert chunks == []
    policy.evaluate(prompts, mask, tokens, token_mask)
    assert chunks == [7]  # 5 rows x 7 positions of a small vocabulary: one chunk
    monkeypatch.setattr(scoring, "AUTO_CHUNK_BYTES", 5 * policy.banned.shape[0] * 4 * 3)  # room for 3 positions of the 5 rows
    policy.evaluate(prompts, mask, tokens, token_mask)
    assert chunks == [7, 3]
    with torch.no_grad():  # logits over one chunk's bytes (a large vocabulary) are chunked without gradients too
        chunked = policy.evaluate(prompts, mask, tokens, token_mask)
    assert chunks == [7, 3, 3]
    torch.testing.assert_close(chunked["token_log_probs"], whole["token_log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked["entropy"], whole["entropy"], atol=1e-5, rtol=1e-5)
    # A pass whose messages have no positions (a micro-batch trimmed to its prompts) has nothing to chunk.
    empty = policy.evaluate(prompts, mask, tokens[:, :0], token_mask[:, :0])
    assert empty["token_log_probs"].shape == (5, 0) and chunks == [7, 3, 3]


def test_scoring_in_chunks_is_refused_when_the_policy_is_built(chat_model, monkeypatch):
    from transformers import LlamaForCausalLM

    folder = chat_model("llama")
    other = {}

    def another_layer(model):  # not the layer the model's logits come from
        head = model.lm_head
        return other.setdefault("layer", torch.nn.Linear(head.in_features, head.out_features, bias=False))

    monkeypatch.setattr(LlamaForCausalLM, "get_output_embeddings", another_layer)
    with pytest.raises(ConfigError, match=r"^score_chunk_tokens: the logits of LlamaForCausalLM are not its output layer"):
        policy_of(folder, max_new_tokens=3, score_chunk_tokens=2)
    automatic = policy_of(folder, max_new_tokens=3)  # the default builds, scoring all logits at once
    assert not automatic.chunkable and automatic.scoring_chunks() is None
    assert policy_of(folder, max_new_tokens=3, score_chunk_tokens=0).scoring_chunks() is None


def test_gradient_checkpointing_gives_the_same_gradient_and_bfloat16_halves_the_weights(chat_model):
    folder = chat_model("llama")
    prompts = torch.randint(300, 900, (4, 9))
    mask = torch.ones_like(prompts, dtype=torch.bool)
    tokens = torch.randint(300, 900, (4, 5))
    token_mask = torch.ones_like(tokens, dtype=torch.bool)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        policy = policy_of(folder, max_new_tokens=5, gradient_checkpointing=checkpointing)
        policy.train()
        policy.evaluate(prompts, mask, tokens, token_mask)["token_log_probs"].sum().backward()
        grads.append({name: p.grad for name, p in policy.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)
    half = policy_of(folder, max_new_tokens=5, dtype="bfloat16")
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    sample = half.sample(prompts, mask, torch.Generator().manual_seed(0))
    assert sample["token_log_probs"].dtype == torch.float32 and bool(sample["token_mask"][:, 0].all())


def test_micro_batches_group_sorted_rows_within_the_budget():
    lengths = torch.tensor([5, 30, 7, 12, 30, 6])
    groups = micro_batches(lengths, 30, budget=40)
    assert sorted(torch.cat(groups).tolist()) == list(range(6))
    for group in groups:
        assert len(group) * int(lengths[group].max()) <= 40
    assert [lengths[group].tolist() for group in groups][0] == [5, 6, 7, 12][: len(groups[0])]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        micro_batches(lengths, 30, budget=20)


# ------------------------------------------------------------------ the chat view
def test_the_chat_view_renders_prompts_through_each_agents_template(chat_model, tmp_path):
    config = chat_config(chat_model("qwen2"), tmp_path)
    scenario = build_scenario(config)
    env = scenario.make_env(4, "train", 0, "cpu")
    assert isinstance(env, DuplicatesChatViewEnv)
    check_env_specs(env)
    td = env.reset()
    tokenizer = scenario.chat_speakers[0].tokenizer
    for agent, name in enumerate(scenario.agent_names):
        prompt = td["agents", "prompt_ids"][0, agent][td["agents", "prompt_mask"][0, agent]]
        text = tokenizer.decode(prompt)
        assert text.startswith("<|im_start|>system\n" + scenario.system_prompt(name))
        assert text.endswith("<|im_start|>assistant\n")
        assert "list: " in text


def test_prompts_rendered_together_are_the_template_applied_to_each(chat_model):
    tokenizer = AutoTokenizer.from_pretrained(chat_model("qwen2"), local_files_only=True)
    lists = [list_line([value, 5, value, 1], [True, index % 2 == 0, True, True], list_format="indexed") for index, value in enumerate(range(6))]
    quotes = [[], [("prover", [7, 8])], [("prover", [7]), ("verifier", [9, 10, 11])]] * 2
    for template in (tokenizer.chat_template, tokenizer.chat_template.replace("message['content']", "message['content'] | upper")):
        tokenizer.chat_template = template  # the second rewrites contents: rendered prompt by prompt
        speaker = ChatSpeaker("prover", tokenizer, "Name the pair.")
        rendered = speaker.render_many(lists, quotes)
        for list_text, quoted, ids in zip(lists, quotes, rendered):
            senders = [f"{sender}: {chr(0xE000)}{index}{chr(0xE000)}" for index, (sender, _) in enumerate(quoted)]
            chat = [{"role": "system", "content": "Name the pair."}, {"role": "user", "content": "\n".join([list_text, *senders])}]
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            parts = text.split(chr(0xE000))
            expected = tokenizer(parts[0], add_special_tokens=False)["input_ids"]
            for index, rest in zip(parts[1::2], parts[2::2]):
                expected += quoted[int(index)][1] + tokenizer(rest, add_special_tokens=False)["input_ids"]
            assert ids == expected
            assert ids == speaker.render(list_text, quoted)
        assert ("LIST: " in tokenizer.decode(rendered[0])) == ("upper" in template)


def test_a_reply_reaches_a_reader_of_another_vocabulary_as_its_text(chat_model, tmp_path):
    # The prover speaks Qwen2's vocabulary, the verifier reads Llama's: the quote is re-encoded, not spliced.
    config = chat_config(chat_model("qwen2"), tmp_path, f"+scenario.agents.verifier.pretrained_path={chat_model('llama')}")
    scenario = build_scenario(config)
    prover, verifier = scenario.chat_speakers
    assert not verifier.reads_as_own(prover) and prover.reads_as_own(prover)
    env = scenario.make_env(2, "train", 0, "cpu")
    td = env.reset()
    reply = prover.tokenizer("cells 4 and 1", add_special_tokens=False)["input_ids"] + [prover.eos_id]
    action = torch.full((2, 2, env.reply_tokens), prover.pad_id)
    action[:, 0, : len(reply)] = torch.tensor(reply)
    td["agents", "action"] = action
    after = env.step(td)["next"]
    for episode in range(2):
        prompt = after["agents", "prompt_ids"][episode, 1][after["agents", "prompt_mask"][episode, 1]]
        assert "prover: cells 4 and 1" in verifier.tokenizer.decode(prompt)
    own = verifier.tokenizer("cells 4 and 1", add_special_tokens=False)["input_ids"]
    assert verifier.quote(prover, [reply[:-1]], 32) == [own]
    assert all(len(quoted) <= 2 for quoted in verifier.quote(prover, [reply[:-1], reply[:1]], 2))  # the prompt width bound holds


def test_replies_are_parsed_by_one_rule():
    assert parse_reply("Accept, the pair is there", True, 8) == (["accept"], "accept")
    assert parse_reply("accept", False, 8) == ([], "none")  # only the verifier decides
    assert parse_reply("cells 4 and 2", False, 8) == (["c4", "c2"], "cells 4 2")
    assert parse_reply("4 4 2", False, 8) == ([], "none")
    assert parse_reply("9 2", False, 8) == ([], "none")
    assert parse_reply("no idea", True, 8) == ([], "none")
    assert read_list_line(list_line([3, 5, 3], [True, False, True], list_format="indexed")) == [3, None, 3]
    assert list_line([3, 5, 3], [True, False, True], list_format="indexed") == "list: 0=3 1=? 2=3"
    assert read_list_line(list_line([3, 5, 3], [True, False, True])) == [3, None, 3]
    # The seen format writes the seen cells only: the values to compare side by side.
    assert list_line([3, 5, 3, 4], [False, True, False, True], list_format="seen") == "list: 1=5 3=4"
    assert read_list_line("list: 1=5 3=4") == [None, 5, None, 4]
    assert list_line([3, 5], [True, True], list_format="seen") == list_line([3, 5], [True, True], list_format="indexed")


def test_honest_chat_replies_reveal_the_pair_and_the_verifier_decides_right(chat_model, tmp_path):
    config = chat_config(chat_model("llama"), tmp_path, "scenario.positive_fraction=0.99")
    scenario = build_scenario(config)
    demonstrations = scenario.demonstrations("train")
    prover, verifier = demonstrations["prover"], demonstrations["verifier"]
    tokenizer = scenario.chat_speakers[0].tokenizer
    eos = tokenizer.eos_token_id
    for demo in (prover, verifier):
        lengths = demo["token_mask"].sum(-1)
        last = demo["tokens"].gather(-1, (lengths - 1).unsqueeze(-1)).squeeze(-1)
        assert bool((last == eos).all())  # every scripted reply ends with the (pad = eos) token
    texts = tokenizer.batch_decode(prover["tokens"], skip_special_tokens=True)
    assert all(parse_reply(text, False, 6)[1].startswith("cells") for text in texts[:20])
    decisions = tokenizer.batch_decode(verifier["tokens"], skip_special_tokens=True)
    assert {"accept"} <= set(decisions)


@pytest.mark.parametrize("family,trainer", [pytest.param("qwen2", "ppo", marks=pytest.mark.slow), pytest.param("llama", "grpo", marks=pytest.mark.slow)])  # 1.6 s and more; test_device_guard trains the chat view with LoRA in the fast tier
def test_the_chat_view_trains_with_lora_and_masks_exactly_the_replies(chat_model, tmp_path, family, trainer):
    overrides = ["scenario.default_agent.lora.r=4", f"trainer={trainer}"]
    if trainer == "grpo":
        # Adapters after a full warm start of the verifier: the reference (adapters off) is the warm-started model.
        overrides += [
            "trainer.group_size=2", "scenario.default_agent.lora.warm_start=full", 'trainer.pretrain.agents=["verifier"]',
            "trainer.pretrain.epochs=2", f"trainer.pretrain.cache_dir={tmp_path / 'pretrained'}",
        ]
    config = chat_config(chat_model(family), tmp_path, *overrides)
    trainer = experiment.build_trainer(config, tmp_path / "run")
    policy = trainer.policy.policy("verifier")
    before = {name: param.detach().clone() for name, param in policy.named_parameters()}
    trainable = {name for name, param in policy.named_parameters() if param.requires_grad}
    assert trainable and all("lora_" in name or name.startswith("value_head") for name in trainable)

    batch = next(trainer._collector_iterator)
    mask, action = batch[keys.TOKEN_MASK_KEY], batch[keys.ACTION_KEY]
    active = batch[keys.ACTIVE_KEY]
    lengths = trainer.train_env.reply_lengths(action.reshape(-1, 2, action.shape[-1])).reshape(active.shape)
    speakers = trainer.scenario.chat_speakers
    # The loss mask is each reply's span: its tokens up to and including the end token, only where the agent acted.
    ended = torch.stack([((action[..., i, :] == s.eos_id) & mask[..., i, :]).any(-1) for i, s in enumerate(speakers)], -1)
    expected = torch.arange(action.shape[-1]) < (lengths + ended.long()).unsqueeze(-1)
    assert bool((mask == (expected & active.unsqueeze(-1))).all())

    # The reference is the same model with its adapters off: no copy, and it equals the policy at the start.
    reference = trainer.reference_policy
    assert not any(True for _ in reference.parameters())
    scores = reference.scores(batch)
    torch.testing.assert_close(scores.token_log_probs, batch[keys.TOKEN_LOG_PROBS_KEY], atol=1e-5, rtol=1e-5)

    metrics = trainer.train_iteration()
    assert 0 <= metrics["train/padding_fraction"] < 1  # the update's scoring passes report their padding
    trainer.train()
    changed = {name for name, param in policy.named_parameters() if not torch.equal(param, before[name])}
    assert changed and changed <= trainable
    saved = trainer.checkpoint_dir / "last" / "verifier"
    assert (saved / "adapter_config.json").is_file() and not (saved / "model.safetensors").exists()
    state = load_checked(trainer.checkpoint_dir / "last.pt")["trainer"]["loss_module"]
    assert all("lora_" in key or "value_head" in key for key in state if "verifier" in key)


@pytest.mark.slow
def test_a_lora_run_exports_merged_standalone_folders(chat_model, tmp_path):
    config = chat_config(chat_model("qwen2"), tmp_path, "scenario.default_agent.lora.r=4", "trainer.num_iterations=2")
    trainer = experiment.build_trainer(config, tmp_path / "run")
    trainer.train()
    trainer.save_checkpoint("last")
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "exported")]) == 0
    exported = tmp_path / "exported" / "verifier"
    assert (exported / "model.safetensors").is_file() and not (exported / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    ids = torch.randint(300, 900, (2, 9))
    live = trainer.policy.policy("verifier").model
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, live(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ bad input
def _break(folder: Path, tmp_path: Path, how: str) -> Path:
    import shutil

    broken = tmp_path / how
    shutil.copytree(folder, broken)
    if how == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (broken / name).unlink(missing_ok=True)
    elif how == "no_template":
        (broken / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((broken / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (broken / "tokenizer_config.json").write_text(json.dumps(config))
    elif how == "truncated":
        weights = broken / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif how == "no_weights":
        (broken / "model.safetensors").unlink()
    elif how == "small_model_vocab":
        config = json.loads((broken / "config.json").read_text())
        config["vocab_size"] = 500
        (broken / "config.json").write_text(json.dumps(config))
        (broken / "model.safetensors").unlink()
        AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(folder).config.__class__(**config)).save_pretrained(broken)
    return broken


@pytest.mark.parametrize(
    "how,message",
    [
        ("no_tokenizer", "has no tokenizer"),
        ("no_template", "no chat_template"),
        ("truncated", "cannot be loaded"),
        ("no_weights", "no weights"),
        ("small_model_vocab", "do not belong together"),
    ],
)
def test_a_bad_model_folder_is_one_line_naming_it(chat_model, tmp_path, how, message):
    folder = _break(chat_model("qwen2"), tmp_path, how)
    config = chat_config(folder, tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        experiment.build_trainer(config, tmp_path / "run")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "override,message",
    [
        ("scenario.default_agent.lora.target_modules=[no_such_layer]", "target_modules"),
        ("scenario.default_agent.max_tokens_per_micro_batch=50", "below one sequence"),
        ("scenario.default_agent.max_new_tokens=5000", "context of the agent.s model"),
    ],
)
def test_sizes_and_adapters_that_cannot_fit_are_one_line(chat_model, tmp_path, override, message):
    config = chat_config(chat_model("qwen2"), tmp_path, "scenario.default_agent.lora.r=4", override)
    with pytest.raises(ConfigError, match=message) as error:
        experiment.build_trainer(config, tmp_path / "run")
    assert "\n" not in str(error.value)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_the_chat_view_without_a_model_folder_builds_a_small_one_once(tmp_path):
    options = (
        "scenario.default_agent.architecture=qwen2", "scenario.default_agent.vocab_size=600",
        "scenario.list_format=indexed",
    )
    config = chat_config(None, tmp_path, *options)
    scenario = build_scenario(config)
    folder = Path(scenario.chat_agent_configs["verifier"].pretrained_path)
    assert folder.parent == tmp_path / "cache" / "chat_models" and (folder / "model.safetensors").is_file()
    assert len(scenario.chat_speakers[0].tokenizer) == 600
    built = (folder / "model.safetensors").stat().st_mtime_ns
    again = build_scenario(chat_config(None, tmp_path, *options))
    assert Path(again.chat_agent_configs["prover"].pretrained_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == built  # built once, then reused
    env = again.make_env(2, "train", 0, "cpu")
    prompt = env.reset()["agents", "prompt_ids"][0, 0]
    assert "list: 0=" in again.chat_speakers[0].tokenizer.decode(prompt)
    with pytest.raises(ConfigError, match="cannot be built for the chat view"):
        build_scenario(chat_config(None, tmp_path, "scenario.default_agent.architecture=mistral")).chat_speakers


def _objective_family_pairs() -> list[tuple[str, str]]:
    """Every RL objective on every family, but each learning-aware one on one family (in turn, so all three get some).

    A learning-aware trainer drives the model through the same scoring and
    update code as the standard objectives do; what differs between families
    (layer layout, LoRA targets, tokenizer) the standard objectives cover on
    all three, at a fraction of the time.
    """
    pairs, turn = [], 0
    for trainer in RL_TRAINERS:
        if issubclass(TRAINERS.get(trainer), LearningAwareTrainer):
            pairs.append((trainer, FAMILIES[turn % len(FAMILIES)]))
            turn += 1
        else:
            pairs.extend((trainer, family) for family in FAMILIES)
    return pairs


@pytest.fixture(scope="module")
def warm_starts(tmp_path_factory) -> Path:
    """One warm-start cache for the module: the fit's key leaves the trainer out, so each family is fitted once."""
    return tmp_path_factory.mktemp("warm_starts")


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "family"), _objective_family_pairs())
def test_every_objective_trains_chat_agents_of_every_family_with_lora(chat_model, warm_starts, tmp_path, family, trainer):
    # A short warm start on honest play (of every weight; the adapters come after it) makes the verifier decide, so that
    # episodes differ in return and the objectives that compare episodes find pairs. More groups, sampled warmer:
    # a group's two decisions differ often enough.
    overrides = [
        "scenario.default_agent.lora.r=4", "scenario.default_agent.lora.warm_start=full", f"trainer={trainer}",
        'trainer.pretrain.agents=["verifier"]',
        "trainer.pretrain.epochs=15", "trainer.pretrain.lr=0.01", "trainer.pretrain.minibatch_size=8",
        f"trainer.pretrain.cache_dir={warm_starts}",
        "trainer.group_size=2", "trainer.num_envs=16", "trainer.frames_per_batch=64", "scenario.default_agent.temperature=2",
    ]
    config = chat_config(chat_model(family), tmp_path, *overrides)
    trainer_ = experiment.build_trainer(config, tmp_path / "run")
    assert "pretrain/verifier/from_cache" in trainer_.pretrain_metrics  # fitted, or loaded from this family's fit
    before = {name: p.detach().clone() for name, p in trainer_.policy.policy("verifier").named_parameters()}
    metrics = trainer_.train()
    assert "test/accuracy" in metrics
    after = dict(trainer_.policy.policy("verifier").named_parameters())
    assert any(not torch.equal(after[name], value) for name, value in before.items())


@pytest.mark.slow
def test_an_interrupted_lora_run_in_the_chat_view_resumes_to_the_same_final_metrics(chat_model, tmp_path, monkeypatch):
    # The adapters, value heads, optimiser and collector carrier resume; the frozen base comes from the folder.
    from tests.test_checkpoint import _interrupt_and_resume

    overrides = (
        "scenario=duplicates", "protocol=nip", "protocol.first_speaker=prover", "protocol.max_rounds=2",
        "scenario.view=chat", f"scenario.default_agent.pretrained_path={chat_model('qwen2')}",
        "scenario.default_agent.max_new_tokens=8", "scenario.default_agent.lora.r=4", "scenario.num_lists=60",
        "scenario.length=6", "scenario.num_values=12", f"scenario.cache_dir={tmp_path / 'data'}",
        "trainer.eval.metric=eval/accuracy",
        # Smaller than the smoke preset's batches (16 environments, 64 test and 32 evaluation episodes): the claim is
        # that the resumed run's metrics equal the reference's, whatever their size.
        "trainer.num_envs=8", "trainer.frames_per_batch=48", "trainer.minibatch_size=16",
        "trainer.num_test_episodes=16", "trainer.test_batch_episodes=16", "trainer.eval.num_episodes=16",
    )
    _interrupt_and_resume(tmp_path, monkeypatch, overrides)


@pytest.mark.slow  # builds the preset's BPE tokenizer and models (about 10 s)
def test_lm_chat_demonstrations_teach_the_verifier_to_compare_not_to_count(tmp_path):
    # The lm_chat verifier once learnt "two cells were named -> accept", which the demonstrations of the even
    # decoy mix rewarded on 0.83 of lists; in the game the prover always names two cells, so it accepted all.
    config = make_config("preset=lm_chat", f"scenario.cache_dir={tmp_path}", "scenario.num_lists=600", "logger=none")
    scenario = build_scenario(config)
    verifier = scenario.demonstrations("train")["verifier"]
    tokenizer = scenario.chat_speakers[scenario.agent_names.index("verifier")].tokenizer
    prompts = tokenizer.batch_decode([ids[mask] for ids, mask in zip(verifier["prompt_ids"], verifier["prompt_mask"])])
    decisions = tokenizer.batch_decode(verifier["tokens"], skip_special_tokens=True)
    counted = compared = 0
    for prompt, decision in zip(prompts, decisions):
        seen = [value for value in read_list_line(prompt) if value is not None]
        assert "?" not in prompt.split("list:")[1].splitlines()[0]  # the seen format: seen cells only
        accepts = decision.strip() == "accept"
        compared += accepts == (len(seen) == 2 and seen[0] == seen[1])
        counted += accepts == (len(seen) == 2)
    assert compared == len(prompts)  # the sound rule: accept exactly when the two seen values are equal
    assert counted / len(prompts) < 0.7  # counting the named cells is a poor guess (it was 0.83)


def test_sampling_runs_in_eval_mode_and_gives_every_module_its_mode_back(chat_model):
    """With gradient checkpointing in train mode some transformers versions (5.17) turn the KV cache off; sampling
    must not depend on that rule: the model samples in eval mode, and afterwards each module has its own mode again."""
    policy = policy_of(chat_model("qwen2"), gradient_checkpointing=True, max_new_tokens=5)
    policy.train()
    policy.model.get_submodule("model.layers.0").eval()  # a mixed state, as a user's frozen part may leave it
    modes = {name: module.training for name, module in policy.named_modules()}
    seen = []
    policy.model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    prompt = policy.tokenizer(["list: 1 2 3"], return_tensors="pt")["input_ids"]
    sample = policy.sample(prompt, torch.ones_like(prompt, dtype=torch.bool), generator=torch.Generator().manual_seed(0))
    assert seen and not any(seen)
    assert int(sample["num_tokens"][0]) >= 1
    assert {name: module.training for name, module in policy.named_modules()} == modes


def test_the_collector_is_built_from_the_actors_spec_without_sampling_and_the_spec_is_what_it_writes(chat_model, tmp_path, monkeypatch):
    # TorchRL's collector sampled a whole batch of messages when it was built, to see the policy's keys (seconds with
    # a 262,144-token vocabulary); the actor's spec now tells it.
    calls = []
    sample = LMPolicy.sample
    monkeypatch.setattr(LMPolicy, "sample", lambda self, *args, **kwargs: calls.append(1) or sample(self, *args, **kwargs))
    trainer = experiment.build_trainer(chat_config(chat_model("qwen2"), tmp_path, "scenario.default_agent.lora.r=4"), tmp_path / "run")
    assert not calls
    batch = next(trainer._collector_iterator)
    assert calls
    spec = trainer.policy.spec
    for key in trainer.policy.out_keys:
        written = batch.get(key)
        assert written.dtype == spec[key].dtype and written.shape[written.ndim - len(spec[key].shape):] == spec[key].shape, key
