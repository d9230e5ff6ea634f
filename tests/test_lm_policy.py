"""Language-model agents (nip_like.lm): tokenizer, sampling, teacher-forced scoring, values, checkpoints.

Every model here is a tiny Llama built from a config: nothing is downloaded.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from nip_like.errors import ConfigError
from nip_like.lm import LMAgentConfig, LMPolicy, build_lm, build_lm_policy, build_tokenizer, load_agent, save_agent
from nip_like.lm.sampling import SamplingSettings, processed_log_probs
from nip_like.lm.policy import position_ids, trim_left_padding, trim_padding_columns
from nip_like.lm.tokenizer import SPECIAL_TOKENS

ALPHABET = ["a", "b", "c", "d", "0", "1"]
PAD, BOS, EOS, UNK = 0, 1, 2, 3
T = 8  # max_new_tokens of the policies below


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread is fastest, and much faster when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(ALPHABET)


def make_policy(tokenizer, seed: int = 0, **overrides) -> LMPolicy:
    torch.manual_seed(seed)
    return build_lm_policy(LMAgentConfig(max_new_tokens=T, **overrides), tokenizer)


def prompts(tokenizer, texts=("a b c d", "1", "0 0 1", "c")):
    """Left-padded prompts of different lengths, ``(B, P)`` ids and bool mask."""
    encoded = tokenizer(list(texts), padding=True, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"].bool()


def add_logit_bias(policy: LMPolicy, bias: dict[int, float]):
    """Add ``bias[token]`` to the model's logits of ``token`` (a forward hook on the LM head)."""
    vector = torch.zeros(policy.model.config.vocab_size)
    for token, value in bias.items():
        vector[token] = value
    return policy.model.get_output_embeddings().register_forward_hook(lambda module, inputs, output: output + vector)


# Tokenizer


def test_tokenizer_ids_are_specials_then_the_alphabet_in_order(tokenizer):
    assert tokenizer.get_vocab() == {token: i for i, token in enumerate([*SPECIAL_TOKENS, *ALPHABET])}
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == SPECIAL_TOKENS
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert tokenizer("b a  1\t0")["input_ids"] == [BOS, 5, 4, 9, 8]
    assert tokenizer("b z", add_special_tokens=False)["input_ids"] == [5, UNK]
    ids, mask = prompts(tokenizer, ("a b", "c"))
    assert ids.tolist() == [[BOS, 4, 5], [PAD, BOS, 6]]
    assert mask.tolist() == [[True, True, True], [False, True, True]]


def test_tokenizer_round_trips_through_a_local_folder(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id, reloaded.unk_token_id) == (0, 1, 2, 3)
    assert reloaded.padding_side == "left"
    texts = ["a b c", "1 0", "d z"]
    assert reloaded(texts, padding=True)["input_ids"] == tokenizer(texts, padding=True)["input_ids"]


@pytest.mark.parametrize(
    ("alphabet", "message"),
    [
        ([], "empty"),
        (["a", "b", "a"], "more than once: 'a'"),
        (["a b"], "without whitespace"),
        (["a\t"], "without whitespace"),
        ([""], "non-empty"),
        (["a", "<eos>"], "special token"),
    ],
)
def test_tokenizer_refuses_bad_alphabets_in_one_line(alphabet, message):
    with pytest.raises(ValueError, match=message) as caught:
        build_tokenizer(alphabet)
    assert "\n" not in str(caught.value)


# Building models


def test_build_lm_is_a_tiny_float32_llama_wired_to_the_tokenizer(tokenizer):
    config = LMAgentConfig(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=48)
    model, same_tokenizer = build_lm(config, tokenizer)
    assert same_tokenizer is tokenizer
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (len(ALPHABET) + 4, 32, 3, 48)
    assert (c.num_attention_heads, c.num_key_value_heads) == (2, 2)
    for settings in (model.config, model.generation_config):
        assert (settings.pad_token_id, settings.bos_token_id, settings.eos_token_id) == (PAD, BOS, EOS)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LMAgentConfig(architecture="no_such_model"), "unknown architecture 'no_such_model'"),
        (LMAgentConfig(architecture="t5"), "has no causal LM"),
        (LMAgentConfig(hidden_size=30, num_heads=4), "multiple of num_heads"),
        (LMAgentConfig(temperature=0.0), "temperature must be >= 0.01"),
        (LMAgentConfig(temperature=1e-45), "temperature must be >= 0.01"),
        (LMAgentConfig(top_p=0.0), "top_p must be in"),
        (LMAgentConfig(max_new_tokens=0), "max_new_tokens must be at least 1"),
    ],
)
def test_bad_agent_configs_fail_in_one_line(tokenizer, config, message):
    with pytest.raises(ConfigError, match=message) as caught:
        build_lm_policy(config, tokenizer)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("path", ["no/such/folder", "meta-llama/Llama-3.2-1B"])
def test_pretrained_path_that_is_not_a_folder_is_refused_in_one_line(tokenizer, path):
    with pytest.raises(ValueError, match="only local folders are read") as caught:
        build_lm(LMAgentConfig(pretrained_path=path), tokenizer)
    assert "\n" not in str(caught.value) and path in str(caught.value)


# Sampling


def test_sample_returns_dense_padded_messages(tokenizer):
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer)
    out = policy.sample(ids, mask, torch.Generator().manual_seed(0))
    B = ids.shape[0]
    assert {key: tuple(value.shape) for key, value in out.items()} == {
        "tokens": (B, T),
        "token_mask": (B, T),
        "token_log_probs": (B, T),
        "token_entropy": (B, T),
        "log_prob": (B,),
        "num_tokens": (B,),
        "finished": (B,),
    }
    assert (out["tokens"].dtype, out["token_mask"].dtype, out["token_log_probs"].dtype) == (
        torch.long,
        torch.bool,
        torch.float32,
    )
    steps = torch.arange(T)
    # The mask is a prefix of num_tokens steps; after it, pad tokens with log-prob exactly 0.
    assert torch.equal(out["token_mask"], steps < out["num_tokens"].unsqueeze(-1))
    assert torch.equal(out["tokens"][~out["token_mask"]], torch.full_like(out["tokens"][~out["token_mask"]], PAD))
    assert torch.equal(out["token_log_probs"][~out["token_mask"]], torch.zeros_like(out["token_log_probs"][~out["token_mask"]]))
    real_log_probs = out["token_log_probs"][out["token_mask"]]
    assert torch.isfinite(real_log_probs).all() and (real_log_probs < 0).all()
    assert torch.equal(out["log_prob"], out["token_log_probs"].sum(-1))
    assert out["num_tokens"].min() >= 1
    # The stored entropies are those of the distributions sampled from, as a teacher-forced pass finds them.
    _, entropy = policy.log_probs(ids, mask, out["tokens"], out["token_mask"])
    torch.testing.assert_close(out["token_entropy"], entropy, atol=1e-5, rtol=0)
    assert (out["token_entropy"][~out["token_mask"]] == 0).all()


def test_greedy_sampling_takes_the_most_likely_token_and_ignores_the_generator(tokenizer):
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer)
    first = policy.sample(ids, mask, torch.Generator().manual_seed(0), greedy=True)
    second = policy.sample(ids, mask, torch.Generator().manual_seed(1), greedy=True)
    assert torch.equal(first["tokens"], second["tokens"])
    # Teacher-forced: at each position the greedy token is the argmax of the processed distribution.
    tokens, token_mask = first["tokens"], first["token_mask"]
    attention = torch.cat([mask, token_mask], -1).long()
    with torch.no_grad():
        logits = policy.model(
            input_ids=torch.cat([ids, tokens], -1), attention_mask=attention, position_ids=position_ids(attention)
        ).logits[:, ids.shape[1] - 1 : -1]
    best = processed_log_probs(logits, policy.banned, policy.settings).argmax(-1)
    assert torch.equal(best[token_mask], tokens[token_mask])



def test_pad_bos_and_unk_are_never_sampled_even_when_the_model_prefers_them(tokenizer):
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer, ["a", "b c", "d 1 0", "0"] * 4)
    hook = add_logit_bias(policy, {PAD: 30.0, BOS: 30.0, UNK: 30.0})
    try:
        out = policy.sample(ids, mask, torch.Generator().manual_seed(1))
        real = out["tokens"][out["token_mask"]]
        assert not torch.isin(real, torch.tensor([PAD, BOS, UNK])).any()
        assert torch.isfinite(out["token_log_probs"]).all()
        # Without the ban the biased tokens would be (nearly) all that is sampled: the test can fail.
        policy.banned.zero_()
        unbanned = policy.sample(ids, mask, torch.Generator().manual_seed(1))
        assert torch.isin(unbanned["tokens"][unbanned["token_mask"]], torch.tensor([PAD, BOS, UNK])).float().mean() > 0.9
    finally:
        hook.remove()


def test_eos_ends_each_row(tokenizer):
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer, ["a", "b c", "d 1 0", "0"] * 4)
    hook = add_logit_bias(policy, {EOS: 1.5})
    try:
        out = policy.sample(ids, mask, torch.Generator().manual_seed(2))
    finally:
        hook.remove()
    tokens, n = out["tokens"], out["num_tokens"]
    assert 0 < out["finished"].sum() < len(n), "the bias should end some rows early and not others"
    for row in range(len(n)):
        is_eos = (tokens[row] == EOS).nonzero().flatten().tolist()
        if out["finished"][row]:
            assert is_eos == [n[row] - 1]
            assert (tokens[row, n[row] :] == PAD).all()
        else:
            assert is_eos == [] and n[row] == T

    hook = add_logit_bias(policy, {EOS: 100.0})
    try:
        out = policy.sample(ids, mask, torch.Generator().manual_seed(2))
    finally:
        hook.remove()
    assert (out["tokens"][:, 0] == EOS).all() and (out["num_tokens"] == 1).all() and out["finished"].all()


def test_seeded_sampling_is_reproducible(tokenizer):
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer, ["a", "b c", "d 1 0", "0"] * 4)
    first = policy.sample(ids, mask, torch.Generator().manual_seed(7))
    again = policy.sample(ids, mask, torch.Generator().manual_seed(7))
    other = policy.sample(ids, mask, torch.Generator().manual_seed(8))
    for key in first:
        assert torch.equal(first[key], again[key]), key
    assert not torch.equal(first["tokens"], other["tokens"])


# Teacher-forced scoring


SETTINGS = [
    pytest.param(dict(temperature=1.0, top_k=0, top_p=1.0), id="plain"),
    pytest.param(dict(temperature=0.7, top_k=3, top_p=1.0), id="temperature-top_k"),
    pytest.param(dict(temperature=1.3, top_k=0, top_p=0.8), id="temperature-top_p"),
    # GPT-2 has absolute positions and dropout 0.1 in its config: train mode must not matter.
    pytest.param(dict(architecture="gpt2", temperature=0.7, top_k=3), id="gpt2"),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_teacher_forced_log_probs_reproduce_the_sampling_log_probs(tokenizer, settings):
    policy = make_policy(tokenizer, **settings).train()
    ids, mask = prompts(tokenizer, ["a b c d", "1", "0 0 1", "c"] * 4)
    out = policy.sample(ids, mask, torch.Generator().manual_seed(3))
    log_probs, entropy = policy.log_probs(ids, mask, out["tokens"], out["token_mask"])
    assert (log_probs - out["token_log_probs"]).abs().max() < 1e-5
    ratio = (log_probs.sum(-1) - out["log_prob"]).exp()
    assert (ratio - 1).abs().max() < 1e-5
    assert torch.equal(log_probs[~out["token_mask"]], torch.zeros_like(log_probs[~out["token_mask"]]))
    assert torch.equal(entropy[~out["token_mask"]], torch.zeros_like(entropy[~out["token_mask"]]))
    assert (entropy[out["token_mask"]] > 0).all()


@pytest.mark.parametrize(
    "settings", [SamplingSettings(0.7, 3, 1.0), SamplingSettings(1.3, 0, 0.8), SamplingSettings(0.5, 5, 0.6)], ids=str
)
def test_processing_matches_hugging_face_warpers(settings):
    """Bans, then temperature, top-k and top-p, as generate() applies them (bad words, then the warpers)."""
    logits = torch.randn(64, 20, generator=torch.Generator().manual_seed(0)) * 3
    banned = torch.zeros(20, dtype=torch.bool)
    banned[[0, 1, 3]] = True
    expected = logits.masked_fill(banned, float("-inf"))
    for warper in (
        TemperatureLogitsWarper(settings.temperature),
        TopKLogitsWarper(settings.top_k) if settings.top_k else None,
        TopPLogitsWarper(settings.top_p) if settings.top_p < 1 else None,
    ):
        expected = warper(None, expected) if warper is not None else expected
    expected = expected.log_softmax(-1)
    actual = processed_log_probs(logits, banned, settings)
    assert torch.equal(actual.isinf(), expected.isinf())
    kept = ~expected.isinf()
    assert (actual[kept] - expected[kept]).abs().max() < 1e-5
    assert (kept.sum(-1) < 17).any(), "top-k or top-p should cut some tokens"


def test_log_probs_are_of_the_processed_distribution(tokenizer):
    """At temperature 0.7 with top-k 3, every token is among the 3 best and its log-prob is the renormalised one."""
    policy = make_policy(tokenizer, temperature=0.7, top_k=3)
    ids, mask = prompts(tokenizer, ["a b c d", "1", "0 0 1", "c"] * 4)
    out = policy.sample(ids, mask, torch.Generator().manual_seed(4))
    # The reference, written out: raw logits of a plain forward, bans, temperature, top 3.
    full_mask = torch.cat([mask, out["token_mask"]], -1).long()
    with torch.no_grad():
        logits = policy.model(
            input_ids=torch.cat([ids, out["tokens"]], -1),
            attention_mask=full_mask,
            position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0),
        ).logits[:, ids.shape[1] - 1 : -1]
    logits[..., [PAD, BOS, UNK]] = float("-inf")
    top3 = logits.topk(3, dim=-1).indices
    real = out["token_mask"]
    assert (top3 == out["tokens"].unsqueeze(-1)).any(-1)[real].all()
    reference = (logits.gather(-1, top3) / 0.7).log_softmax(-1)
    expected = reference.gather(-1, (top3 == out["tokens"].unsqueeze(-1)).float().argmax(-1, keepdim=True)).squeeze(-1)
    assert (expected[real] - out["token_log_probs"][real]).abs().max() < 1e-5
    # And not the raw model's log-probs.
    raw = logits.log_softmax(-1).gather(-1, out["tokens"].unsqueeze(-1)).squeeze(-1)
    assert (raw[real] - out["token_log_probs"][real]).abs().max() > 1e-2


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_left_padding_and_batching_do_not_change_the_log_probs(tokenizer, architecture):
    """Position ids count real tokens only (GPT-2's absolute positions would show an offset; Llama's RoPE not)."""
    policy = make_policy(tokenizer, architecture=architecture)
    texts = ["a b c d", "1", "0 0 1"]
    ids, mask = prompts(tokenizer, texts)
    out = policy.sample(ids, mask, torch.Generator().manual_seed(5))
    batched, _ = policy.log_probs(ids, mask, out["tokens"], out["token_mask"])
    for row, text in enumerate(texts):
        alone_ids, alone_mask = prompts(tokenizer, [text])
        n = int(out["num_tokens"][row])
        alone, _ = policy.log_probs(
            alone_ids, alone_mask, out["tokens"][row : row + 1, :n], out["token_mask"][row : row + 1, :n]
        )
        assert (alone[0] - batched[row, :n]).abs().max() < 1e-5


def test_empty_slots_inside_and_after_prompts_are_trimmed_without_changing_the_scores(tokenizer, monkeypatch):
    """A fixed layout with empty slots (the token view's prompts) is scored over its real columns and its last one."""
    policy = make_policy(tokenizer, value_head=True)
    ids, mask = prompts(tokenizer, ["a b c d", "1 0", "0 0 1"])
    # Two empty slots inside every row, three at the end: 5 columns are padding everywhere.
    ids = torch.cat([ids[:, :2], torch.full((3, 2), PAD), ids[:, 2:], torch.full((3, 3), PAD)], dim=-1)
    mask = torch.cat([mask[:, :2], torch.zeros(3, 2, dtype=torch.bool), mask[:, 2:], torch.zeros(3, 3, dtype=torch.bool)], dim=-1)
    trimmed_ids, trimmed_mask = trim_padding_columns(ids, mask)
    assert trimmed_ids.shape[1] == mask.any(0).sum() + 1  # the last column stays: it predicts the first token
    kept = mask.any(0)
    kept[-1] = True
    assert torch.equal(trimmed_ids, ids[:, kept]) and torch.equal(trimmed_mask, mask[:, kept])
    out = policy.sample(ids, mask, torch.Generator().manual_seed(5))
    args = (ids, mask, out["tokens"], out["token_mask"])
    scores = policy.evaluate(*args)
    monkeypatch.setattr("nip_like.lm.policy.trim_padding_columns", trim_left_padding)  # the full width, as before
    untrimmed = policy.evaluate(*args)
    for name in ("token_log_probs", "entropy", "value"):
        assert torch.allclose(scores[name], untrimmed[name], atol=1e-6), name
    assert torch.allclose(scores["token_log_probs"], out["token_log_probs"], atol=1e-5)


def test_gradients_flow_through_log_probs_and_entropy(tokenizer):
    policy = make_policy(tokenizer, temperature=0.7, top_k=4)
    ids, mask = prompts(tokenizer)
    out = policy.sample(ids, mask, torch.Generator().manual_seed(6))
    log_probs, entropy = policy.log_probs(ids, mask, out["tokens"], out["token_mask"])
    assert log_probs.requires_grad and entropy.requires_grad
    (-(log_probs.sum() + 0.01 * entropy.sum())).backward()
    for name, parameter in policy.model.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
    assert policy.model.get_output_embeddings().weight.grad.abs().sum() > 0
    assert policy.model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


# Values


@pytest.mark.parametrize("shared_body", [True, False])
def test_value_head_shapes_and_gradients(tokenizer, shared_body):
    policy = make_policy(tokenizer, shared_body=shared_body)
    ids, mask = prompts(tokenizer)
    out = policy.sample(ids, mask, torch.Generator().manual_seed(0))
    value = policy.value(ids, mask, out["tokens"], out["token_mask"])
    assert value.shape == (ids.shape[0],) and value.dtype == torch.float32
    evaluated = policy.evaluate(ids, mask, out["tokens"], out["token_mask"])
    assert torch.allclose(evaluated["value"], value, atol=1e-6)
    value.sum().backward()
    assert policy.value_head.linear.weight.grad.abs().sum() > 0
    body = policy.model.model if shared_body else policy.value_head.body
    assert body.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    if not shared_body:
        assert all(parameter.grad is None for parameter in policy.model.parameters())
        assert not any(body_p is model_p for body_p in body.parameters() for model_p in policy.model.parameters())


def test_value_reads_the_last_real_token(tokenizer):
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer)
    out = policy.sample(ids, mask, torch.Generator().manual_seed(0))
    tokens, token_mask = out["tokens"].clone(), out["token_mask"]
    with torch.no_grad():
        value = policy.value(ids, mask, tokens, token_mask)
        # Masked-out positions do not matter...
        tokens[~token_mask] = 5
        assert torch.allclose(policy.value(ids, mask, tokens, token_mask), value, atol=1e-6)
        # ...the last real token does.
        last = out["num_tokens"] - 1
        rows = torch.arange(len(last))
        tokens[rows, last] = torch.where(tokens[rows, last] == 4, 6, 4)
        assert ((policy.value(ids, mask, tokens, token_mask) - value).abs() > 1e-6).all()
        # With no message, the value is that of the prompt's last token.
        empty = torch.zeros((len(last), 0), dtype=torch.long)
        alone = policy.value(ids, mask, empty, empty.bool())
        padded = policy.value(ids, mask, torch.full_like(tokens, PAD), torch.zeros_like(token_mask))
        assert torch.allclose(alone, padded, atol=1e-6)


# Checkpoints


@pytest.mark.parametrize("shared_body", [True, False])
def test_saved_agent_reloads_with_plain_from_pretrained(tokenizer, tmp_path, shared_body):
    policy = make_policy(tokenizer, shared_body=shared_body)
    with torch.no_grad():  # make the value head differ from a fresh one
        policy.value_head.linear.bias.fill_(0.25)
    save_agent(tmp_path, policy.model, policy.tokenizer, policy.value_head)
    ids, mask = prompts(tokenizer)
    full_mask = mask.long()
    inputs = dict(input_ids=ids, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0))

    plain = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    with torch.no_grad():
        assert torch.equal(plain(**inputs).logits, policy.model(**inputs).logits)
    assert AutoTokenizer.from_pretrained(tmp_path, local_files_only=True).get_vocab() == tokenizer.get_vocab()

    model, reloaded_tokenizer, value_head = load_agent(tmp_path)
    assert value_head.shared_body == shared_body
    for key, tensor in policy.value_head.state_dict().items():
        assert torch.equal(value_head.state_dict()[key], tensor), key

    reloaded = build_lm_policy(LMAgentConfig(pretrained_path=str(tmp_path), max_new_tokens=T, shared_body=shared_body))
    first = policy.sample(ids, mask, torch.Generator().manual_seed(9))
    second = reloaded.sample(ids, mask, torch.Generator().manual_seed(9))
    assert torch.equal(first["tokens"], second["tokens"])
    with torch.no_grad():
        assert torch.equal(
            policy.value(ids, mask, first["tokens"], first["token_mask"]),
            reloaded.value(ids, mask, first["tokens"], first["token_mask"]),
        )


def test_saving_without_a_value_head_removes_a_stale_one(tokenizer, tmp_path):
    policy = make_policy(tokenizer)
    save_agent(tmp_path, policy.model, policy.tokenizer, policy.value_head)
    save_agent(tmp_path, policy.model, policy.tokenizer)
    assert load_agent(tmp_path)[2] is None


def test_a_save_that_fails_half_way_leaves_the_previous_agent_whole(tokenizer, tmp_path, monkeypatch):
    policy = make_policy(tokenizer)
    folder = tmp_path / "agent"
    save_agent(folder, policy.model, policy.tokenizer, policy.value_head)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    with torch.no_grad():
        next(policy.model.parameters()).add_(1.0)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(policy.tokenizer, "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        save_agent(folder, policy.model, policy.tokenizer, policy.value_head)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    monkeypatch.undo()
    save_agent(folder, policy.model, policy.tokenizer, policy.value_head)  # the leftover is cleared
    assert sorted(path.name for path in tmp_path.iterdir()) == ["agent"]
    assert {path.name: path.read_bytes() for path in folder.iterdir()} != before


def test_a_saved_value_head_must_match_the_config(tokenizer, tmp_path):
    policy = make_policy(tokenizer, shared_body=True)
    save_agent(tmp_path, policy.model, policy.tokenizer, policy.value_head)
    with pytest.raises(ConfigError, match="has shared_body=True, the config asks for shared_body=False"):
        build_lm_policy(LMAgentConfig(pretrained_path=str(tmp_path), shared_body=False))


# Devices


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_and_scoring_on_cuda(tokenizer):
    policy = make_policy(tokenizer, temperature=0.7, top_k=3).to("cuda")
    ids, mask = prompts(tokenizer, ["a b c d", "1", "0 0 1", "c"] * 4)
    ids, mask = ids.cuda(), mask.cuda()
    out = policy.sample(ids, mask, torch.Generator("cuda").manual_seed(0))
    assert all(value.device.type == "cuda" for value in out.values())
    log_probs, _ = policy.log_probs(ids, mask, out["tokens"], out["token_mask"])
    assert (log_probs - out["token_log_probs"]).abs().max() < 1e-4
    again = policy.sample(ids, mask, torch.Generator("cuda").manual_seed(0))
    assert torch.equal(out["tokens"], again["tokens"])
    assert policy.value(ids, mask, out["tokens"], out["token_mask"]).device.type == "cuda"
    from_cpu_generator = policy.sample(ids, mask, torch.Generator().manual_seed(0))
    assert from_cpu_generator["tokens"].device.type == "cuda"
