"""Decoding with a static KV cache (nip_like.lm.static_decoding): the eager loop's messages, the same distribution.

Tiny models built from configs (nothing is downloaded), on the CPU: the
static path runs uncompiled here (``decoding="static"``); the compiled step
(``torch.compile``, about a minute to build on two busy cores) is checked in
one slow test, and its CUDA graphs only on a GPU (``scripts/gpu_check.py``).
"""

from __future__ import annotations

import copy
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from nip_like.errors import ConfigError
from nip_like.lm import LMAgentConfig, LMPolicy, build_lm_policy, build_tokenizer
from nip_like.lm import static_decoding
from nip_like.lm.decoding import decode
from nip_like.lm.lora import LoraOptions
from nip_like.lm.sampling import processed_log_probs
from nip_like.lm.static_decoding import CAPACITY_MULTIPLE, Decoder, sampling_model

ALPHABET = ["a", "b", "c", "d", "0", "1"]
PAD, BOS, EOS, UNK = 0, 1, 2, 3
T = 10
#: The architectures the LM tests build (Llama by default, GPT-2's absolute positions, the chat view's Qwen2,
#: Mistral's sliding window).
ARCHITECTURES = ["llama", "qwen2", "mistral", "gpt2"]
LOGGER = "nip_like.lm.static_decoding"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    """Each choice is logged once per process: each test starts with nothing logged."""
    monkeypatch.setattr(static_decoding, "_LOGGED", set())


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(ALPHABET)


def make_policy(tokenizer, seed: int = 0, **overrides) -> LMPolicy:
    torch.manual_seed(seed)
    return build_lm_policy(LMAgentConfig(max_new_tokens=T, **overrides), tokenizer)


def prompts(tokenizer, texts=("a b c d", "1", "0 0 1", "c", "d d a b 1 0", "b")):
    """Left-padded prompts of different lengths."""
    encoded = tokenizer(list(texts), padding=True, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"].bool()


def add_logit_bias(policy: LMPolicy, bias: dict[int, float]):
    vector = torch.zeros(policy.model.config.vocab_size)
    for token, value in bias.items():
        vector[token] = value
    return policy.model.get_output_embeddings().register_forward_hook(lambda module, inputs, output: output + vector)


def sample(policy: LMPolicy, mode: str, ids, mask, seed=None, greedy=False, sampling_dtype="model"):
    """``policy.sample`` with a decoder of ``mode``; the decoder is returned too."""
    policy.decoder = Decoder(mode, sampling_dtype)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return policy.sample(ids, mask, generator, greedy=greedy), policy.decoder


def assert_same_messages(eager: dict, static: dict) -> None:
    """The same tokens, masks, counts and endings; the same log-probabilities and entropies to float error."""
    for key in ("tokens", "token_mask", "num_tokens", "finished"):
        assert torch.equal(eager[key], static[key]), key
    for key in ("token_log_probs", "token_entropy", "log_prob"):
        torch.testing.assert_close(eager[key], static[key], atol=1e-5, rtol=0, msg=key)
    assert eager.keys() == static.keys()


# Greedy decoding: the same messages


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_messages_equal_the_eager_loop(tokenizer, architecture):
    policy = make_policy(tokenizer, architecture=architecture)
    ids, mask = prompts(tokenizer)
    mixed = 0
    # Eos biases, smallest first, until one ends some rows early and lets others run to T.
    for bias in sorted(torch.arange(-3.0, 3.0, 0.1).tolist(), key=abs):
        hook = add_logit_bias(policy, {EOS: bias})
        try:
            eager, _ = sample(policy, "eager", ids, mask, greedy=True)
            static, decoder = sample(policy, "static", ids, mask, greedy=True)
        finally:
            hook.remove()
        assert decoder.last_path == "static" and decoder.last_capacity == ids.shape[1] + T
        assert_same_messages(eager, static)
        mixed += 0 < int(eager["finished"].sum()) < len(ids)
        if mixed:
            break
    assert mixed, "some eos bias should end some rows early and not others"


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_a_left_padded_row_decodes_as_it_does_alone(tokenizer, architecture):
    """Position ids count real tokens: padding changes no message (GPT-2's absolute positions would show it)."""
    policy = make_policy(tokenizer, architecture=architecture)
    texts = ["a b c d", "1", "0 0 1"]
    ids, mask = prompts(tokenizer, texts)
    batched, _ = sample(policy, "static", ids, mask, greedy=True)
    for row, text in enumerate(texts):
        alone, _ = sample(policy, "static", *prompts(tokenizer, [text]), greedy=True)
        assert torch.equal(alone["tokens"][0], batched["tokens"][row])
        torch.testing.assert_close(alone["token_log_probs"][0], batched["token_log_probs"][row], atol=1e-5, rtol=0)


def test_extra_padding_columns_change_nothing(tokenizer):
    """Columns that are padding in every row are trimmed, as the eager loop does."""
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer)
    wide_ids = torch.cat([torch.full((len(ids), 3), PAD), ids], -1)
    wide_mask = torch.cat([torch.zeros((len(ids), 3), dtype=torch.bool), mask], -1)
    narrow, _ = sample(policy, "static", ids, mask, greedy=True)
    wide, decoder = sample(policy, "static", wide_ids, wide_mask, greedy=True)
    assert decoder.last_capacity == ids.shape[1] + T
    assert_same_messages(narrow, wide)


def test_stop_strings_end_messages_as_in_the_eager_loop(tokenizer):
    policy = make_policy(tokenizer, stop_strings=["b", "0 1"])
    ids, mask = prompts(tokenizer, ["a b c d", "1", "0 0 1", "c", "d d a b 1 0", "b"] * 2)
    for seed in (0, 1):
        eager, _ = sample(policy, "eager", ids, mask, seed=seed)
        static, _ = sample(policy, "static", ids, mask, seed=seed)
        assert_same_messages(eager, static)
    texts = [policy.tokenizer.decode(row[real].tolist()) for row, real in zip(static["tokens"], static["token_mask"])]
    stopped = [text for text, done in zip(texts, static["finished"].tolist()) if done and not text.endswith("<eos>")]
    assert stopped, "some message should end with a stop string"
    assert all(text.endswith("b") or text.endswith("0 1") for text in stopped)


def test_banned_tokens_are_never_sampled(tokenizer):
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer, ["a", "b c", "d 1 0", "0"] * 4)
    hook = add_logit_bias(policy, {PAD: 30.0, BOS: 30.0, UNK: 30.0})
    try:
        eager, _ = sample(policy, "eager", ids, mask, seed=1)
        static, _ = sample(policy, "static", ids, mask, seed=1)
        greedy, _ = sample(policy, "static", ids, mask, greedy=True)
    finally:
        hook.remove()
    assert_same_messages(eager, static)
    for out in (static, greedy):
        assert not torch.isin(out["tokens"][out["token_mask"]], torch.tensor([PAD, BOS, UNK])).any()
        assert torch.isfinite(out["token_log_probs"]).all()


def test_an_immediate_eos_ends_every_row_after_one_pass(tokenizer):
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer)
    hook = add_logit_bias(policy, {EOS: 100.0})
    try:
        out, decoder = sample(policy, "static", ids, mask, seed=0)
    finally:
        hook.remove()
    assert (out["tokens"][:, 0] == EOS).all() and (out["num_tokens"] == 1).all() and out["finished"].all()
    assert (out["tokens"][:, 1:] == PAD).all() and (out["token_log_probs"][:, 1:] == 0).all()
    assert decoder.last_passes <= static_decoding.CHECK_EVERY  # rows that ended are noticed within CHECK_EVERY tokens


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(gradient_checkpointing=True), id="gradient-checkpointing"),
        pytest.param(dict(lora=LoraOptions(r=4)), id="lora"),
        pytest.param(dict(architecture="qwen2", temperature=0.7, top_k=3, top_p=0.9), id="qwen2-settings"),
    ],
)
def test_lora_checkpointing_and_sampling_settings_decode_alike(tokenizer, overrides):
    policy = make_policy(tokenizer, **overrides).train()  # sample() switches to eval mode itself
    ids, mask = prompts(tokenizer)
    eager, _ = sample(policy, "eager", ids, mask, greedy=True)
    static, decoder = sample(policy, "static", ids, mask, greedy=True)
    assert decoder.last_path == "static"
    assert_same_messages(eager, static)
    assert policy.training  # the mode is given back


# Sampling: the same distribution


def test_seeded_sampling_draws_the_same_messages_as_the_eager_loop_on_the_cpu(tokenizer):
    """Each token is drawn by the same multinomial call from the same probabilities, so on the CPU even the draws agree."""
    policy = make_policy(tokenizer, temperature=0.8, top_k=5)
    ids, mask = prompts(tokenizer, ["a b c d", "1", "0 0 1", "c"] * 4)
    eager, _ = sample(policy, "eager", ids, mask, seed=3)
    static, _ = sample(policy, "static", ids, mask, seed=3)
    assert_same_messages(eager, static)
    again, _ = sample(policy, "static", ids, mask, seed=3)
    assert_same_messages(static, again)


def test_stored_log_probs_are_those_teacher_forced_scoring_finds(tokenizer):
    """The PPO ratio starts at 1 on the static path too."""
    policy = make_policy(tokenizer, temperature=1.3, top_p=0.8)
    ids, mask = prompts(tokenizer, ["a b c d", "1", "0 0 1", "c"] * 3)
    out, _ = sample(policy, "static", ids, mask, seed=5)
    log_probs, entropy = policy.log_probs(ids, mask, out["tokens"], out["token_mask"])
    assert (log_probs - out["token_log_probs"]).abs().max() < 1e-5
    assert (entropy - out["token_entropy"]).abs().max() < 1e-5


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's goodness-of-fit p-value; categories expected fewer than ``min_expected`` times are pooled into one.

    Impossible categories (expected 0) must not be observed at all.
    """
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "a pair of probability 0 was drawn"
    observed, expected = observed[~impossible], expected[~impossible]
    small = expected < min_expected
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().unsqueeze(0)])
        expected = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    return chi_square_survival(float(((observed - expected) ** 2 / expected).sum()), len(observed) - 1)


def chi_square_survival(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with ``dof`` degrees of freedom (the regularised upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_first_two_tokens_follow_the_same_distribution_on_both_paths(tokenizer):
    """Chi-square goodness of fit of (first, second) token pairs, 4,000 draws per path, against the exact distribution.

    The exact probabilities come from teacher-forced passes: the first
    token's from the prompt, the second's from prompt plus each first token.
    Each path is drawn with its own seed, so this checks the distribution,
    not the draws.
    """
    policy = make_policy(tokenizer, seed=1, temperature=1.5, top_k=6)
    policy.max_new_tokens = 2
    vocab = policy.model.config.vocab_size
    ids, mask = prompts(tokenizer, ["a 0 c"])
    with torch.no_grad():
        first = processed_log_probs(policy.model(input_ids=ids, attention_mask=mask.long()).logits[0, -1], policy.banned,
                                    policy.settings).exp()
        extended = torch.cat([ids.expand(vocab, -1), torch.arange(vocab).unsqueeze(-1)], -1)
        second = processed_log_probs(policy.model(input_ids=extended).logits[:, -1], policy.banned, policy.settings).exp()
    # A pair (t1, t2); a first <eos> ends the message: (eos, pad).
    exact = first.unsqueeze(-1) * second
    exact[EOS] = 0
    exact[EOS, PAD] = first[EOS]
    assert torch.allclose(exact.sum(), torch.tensor(1.0), atol=1e-5)
    draws = 4000
    counts = {}
    for mode, seed in (("eager", 11), ("static", 12)):
        out, _ = sample(policy, mode, ids.expand(draws, -1), mask.expand(draws, -1), seed=seed)
        pairs = out["tokens"][:, 0] * vocab + out["tokens"][:, 1]
        counts[mode] = torch.bincount(pairs, minlength=vocab * vocab).double()
        p_value = chi_square_p_value(counts[mode], exact.flatten().double() * draws)
        assert p_value > 1e-3, (mode, p_value)
        total_variation = 0.5 * float((counts[mode] / draws - exact.flatten().double()).abs().sum())
        assert total_variation < 0.06, (mode, total_variation)
    assert int((exact > 0.01).sum()) >= 10, "the test needs a distribution over many pairs"
    # And the two paths against each other: a two-sample (homogeneity) chi-square over the pairs either drew.
    seen = (counts["eager"] + counts["static"]) > 0
    table = torch.stack([counts["eager"][seen], counts["static"][seen]])
    expected = table.sum(0, keepdim=True) * table.sum(1, keepdim=True) / table.sum()
    keep = expected.min(0).values >= 5
    statistic = float(((table[:, keep] - expected[:, keep]) ** 2 / expected[:, keep]).sum())
    p_value = chi_square_survival(statistic, int(keep.sum()) - 1)
    assert p_value > 1e-3, p_value


# Choosing the path, and falling back


def records(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == LOGGER]


def test_auto_decodes_eagerly_on_the_cpu_and_says_so_once(tokenizer, caplog):
    policy = make_policy(tokenizer)
    assert policy.decoder.mode == "auto"
    ids, mask = prompts(tokenizer)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = policy.sample(ids, mask, torch.Generator().manual_seed(0))
        policy.sample(ids, mask, torch.Generator().manual_seed(1))
        make_policy(tokenizer, seed=1).sample(ids, mask)  # another agent makes the same choice: not logged again
    assert policy.decoder.last_path == "eager"
    logged = records(caplog)
    assert len(logged) == 1 and logged[0].levelno == logging.INFO and "eager on cpu" in logged[0].getMessage()
    # The eager path is nip_like.lm.decoding.decode itself.
    with torch.no_grad():
        direct = decode(policy.model.eval(), ids, mask, torch.Generator().manual_seed(0), False,
                        max_new_tokens=T, pad_token_id=PAD, eos_token_id=EOS, banned=policy.banned, settings=policy.settings,
                        keeps_logits=policy._keeps_logits, cache_argument=policy._cache_argument)
    for key in out:
        assert torch.equal(out[key], direct[key]), key


def test_a_model_without_static_cache_support_falls_back_to_eager_logged_once(tokenizer, caplog, monkeypatch):
    policy = make_policy(tokenizer)
    monkeypatch.setattr(type(policy.model), "_can_compile_fullgraph", False)
    ids, mask = prompts(tokenizer)
    policy.decoder = Decoder("static")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = policy.sample(ids, mask, greedy=True)
        policy.sample(ids, mask, greedy=True)
    assert policy.decoder.last_path == "eager"
    logged = records(caplog)
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "eager instead of static" in logged[0].getMessage() and "_can_compile_fullgraph" in logged[0].getMessage()
    eager, _ = sample(policy, "eager", ids, mask, greedy=True)
    assert_same_messages(eager, out)


def test_a_sliding_window_shorter_than_the_cache_falls_back_to_eager(tokenizer, caplog):
    policy = make_policy(tokenizer, architecture="mistral")
    policy.model.config.sliding_window = 4
    ids, mask = prompts(tokenizer)
    policy.decoder = Decoder("compiled")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = policy.sample(ids, mask, greedy=True)
        policy.sample(ids, mask, greedy=True)
    assert policy.decoder.last_path == "eager" and not policy.decoder.compiled_shapes
    warnings = [record for record in records(caplog) if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sliding window of 4 tokens" in warnings[0].getMessage()
    eager, _ = sample(policy, "eager", ids, mask, greedy=True)
    assert_same_messages(eager, out)


def test_a_failing_compilation_falls_back_to_the_uncompiled_step_logged_once(tokenizer, caplog, monkeypatch):
    def broken(*args):
        raise RuntimeError("no compiler here\nsecond line")

    monkeypatch.setattr(static_decoding, "compiled_step", lambda: broken)
    policy = make_policy(tokenizer)
    ids, mask = prompts(tokenizer)
    policy.decoder = Decoder("compiled")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = policy.sample(ids, mask, greedy=True)
        again = policy.sample(ids, mask, greedy=True)
    assert policy.decoder.last_path == "static"
    assert policy.decoder.compile_error == "RuntimeError: no compiler here"
    warnings = [record for record in records(caplog) if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch.compile failed: RuntimeError: no compiler here" in warnings[0].getMessage()
    eager, _ = sample(policy, "eager", ids, mask, greedy=True)
    assert_same_messages(eager, out)
    assert_same_messages(eager, again)


def test_the_compiled_path_keeps_its_cache_rounded_up_and_growing_by_doubling(tokenizer, monkeypatch):
    """The held cache (its tensors' addresses are in the CUDA graphs) is reused while it fits; few shapes compile."""
    monkeypatch.setattr(static_decoding, "compiled_step", lambda: static_decoding.decode_step)  # no compiler needed
    policy = make_policy(tokenizer)
    decoder = policy.decoder = Decoder("compiled")
    ids, mask = prompts(tokenizer)
    policy.sample(ids, mask, greedy=True)
    assert decoder.last_path == "compiled" and decoder.last_capacity == CAPACITY_MULTIPLE
    cache = decoder._held[len(ids)].cache
    policy.sample(ids[:, 3:], mask[:, 3:], greedy=True)  # shorter prompts: the same cache, the same shape
    assert decoder._held[len(ids)].cache is cache and decoder.compiled_shapes == {(len(ids), CAPACITY_MULTIPLE, torch.float32)}
    long_ids, long_mask = prompts(tokenizer, [" ".join(["a"] * 60), "b"] * 3)
    policy.sample(long_ids, long_mask, greedy=True)
    assert decoder.last_capacity == 2 * CAPACITY_MULTIPLE  # 61 + 10 slots: at least double
    assert len(decoder.compiled_shapes) == 2
    for rows in (2, 3, 4):  # at most HELD_CACHES batch sizes are held
        policy.sample(ids[:rows], mask[:rows], greedy=True)
    assert len(decoder._held) == static_decoding.HELD_CACHES
    decoder.release()
    assert not decoder._held


def test_compiled_shapes_beyond_the_limit_run_uncompiled_logged_once(tokenizer, caplog, monkeypatch):
    monkeypatch.setattr(static_decoding, "compiled_step", lambda: static_decoding.decode_step)
    monkeypatch.setattr(static_decoding, "MAX_COMPILED_SHAPES", 1)
    policy = make_policy(tokenizer)
    policy.decoder = Decoder("compiled")
    ids, mask = prompts(tokenizer)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        policy.sample(ids, mask, greedy=True)
        assert policy.decoder.last_path == "compiled"
        for rows in (2, 3):
            policy.sample(ids[:rows], mask[:rows], greedy=True)
            assert policy.decoder.last_path == "static"
    assert sum("shapes (rows, slots) compiled already" in record.getMessage() for record in records(caplog)) == 1


def test_the_decoding_options_are_checked(tokenizer):
    with pytest.raises(ConfigError, match="decoding must be one of auto, eager, static, compiled"):
        make_policy(tokenizer, decoding="fast")
    with pytest.raises(ConfigError, match="sampling_dtype must be one of model, bfloat16"):
        make_policy(tokenizer, sampling_dtype="float16")
    policy = make_policy(tokenizer, decoding="static", sampling_dtype="bfloat16")
    assert (policy.decoder.mode, policy.decoder.sampling_dtype) == ("static", "bfloat16")


def test_a_copied_policy_gets_a_decoder_of_its_own_with_nothing_held(tokenizer, monkeypatch):
    monkeypatch.setattr(static_decoding, "compiled_step", lambda: static_decoding.decode_step)
    policy = make_policy(tokenizer, decoding="compiled")
    ids, mask = prompts(tokenizer)
    policy.sample(ids, mask, greedy=True)
    assert policy.decoder._held
    duplicate = copy.deepcopy(policy)
    assert duplicate.decoder is not policy.decoder and duplicate.decoder.mode == "compiled" and not duplicate.decoder._held
    assert_same_messages(policy.sample(ids, mask, greedy=True), duplicate.sample(ids, mask, greedy=True))


# bfloat16 sampling weights


def test_bfloat16_sampling_copy_follows_the_model_and_stays_out_of_its_parameters(tokenizer):
    policy = make_policy(tokenizer, sampling_dtype="bfloat16", temperature=0.9)
    ids, mask = prompts(tokenizer, ["a b c d", "1", "0 0 1", "c"] * 3)
    names = [name for name, _ in policy.named_parameters()]
    out = policy.sample(ids, mask, torch.Generator().manual_seed(0))
    copy_model = sampling_model(policy.model, "bfloat16")
    assert copy_model is not policy.model and not copy_model.training
    assert all(parameter.dtype == torch.bfloat16 for parameter in copy_model.parameters())
    assert all(parameter.dtype == torch.float32 for parameter in policy.model.parameters())
    assert [name for name, _ in policy.named_parameters()] == names  # not a submodule: no optimiser or checkpoint sees it
    assert not any(key.startswith("decoder") for key in policy.state_dict())
    # Rotary frequencies and other buffers keep their dtype.
    assert {buffer.dtype for buffer in copy_model.buffers()} == {buffer.dtype for buffer in policy.model.buffers()}
    # The stored log-probabilities are the bf16 model's: float32 scoring finds them within bf16 error.
    scored, _ = policy.log_probs(ids, mask, out["tokens"], out["token_mask"])
    gap = (scored - out["token_log_probs"]).abs().max()
    assert 0 < gap < 0.1
    # A parameter written in place (an optimiser step) reaches the copy before the next call; unchanged ones are not copied.
    weight = policy.model.get_output_embeddings().weight
    with torch.no_grad():
        weight.mul_(-1.0)
    assert sampling_model(policy.model, "bfloat16") is copy_model
    torch.testing.assert_close(copy_model.get_output_embeddings().weight, weight.to(torch.bfloat16))
    # A fused optimiser writes the parameters without moving their version counters: its steps are counted instead.
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=0.1, fused=True)
    for parameter in policy.model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    assert sampling_model(policy.model, "bfloat16") is copy_model
    for source, target in zip(policy.model.parameters(), copy_model.parameters()):
        torch.testing.assert_close(target, source.detach().to(torch.bfloat16))
    # Both paths sample with the copy.
    greedy_eager, _ = sample(policy, "eager", ids, mask, greedy=True, sampling_dtype="bfloat16")
    greedy_static, _ = sample(policy, "static", ids, mask, greedy=True, sampling_dtype="bfloat16")
    assert torch.equal(greedy_eager["tokens"], greedy_static["tokens"])


def test_a_bfloat16_model_is_its_own_sampling_copy(tokenizer):
    policy = make_policy(tokenizer, dtype="bfloat16", sampling_dtype="bfloat16")
    assert sampling_model(policy.model, "bfloat16") is policy.model


# The compiled step itself (torch.compile; CUDA graphs need a GPU)


@pytest.mark.slow
def test_the_compiled_step_decodes_the_eager_messages(tokenizer):
    """torch.compile(mode="reduce-overhead") on the CPU (no CUDA graphs there): the same greedy messages, no recompiling."""
    policy = make_policy(tokenizer, architecture="qwen2", decoding="compiled")
    ids, mask = prompts(tokenizer)
    eager, _ = sample(policy, "eager", ids, mask, greedy=True)
    policy.decoder = Decoder("compiled")
    for width in (0, 2):  # a narrower batch reuses the cache and the compiled shape
        out = policy.sample(ids[:, width:], mask[:, width:], greedy=True)
        assert policy.decoder.last_path == "compiled" and policy.decoder.compile_error is None
        if width == 0:
            assert_same_messages(eager, out)
    assert len(policy.decoder.compiled_shapes) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_compiled_decoding_on_cuda_matches_eager_and_samples_alike(tokenizer, architecture):
    policy = make_policy(tokenizer, architecture=architecture).to("cuda")
    ids, mask = (tensor.cuda() for tensor in prompts(tokenizer))
    eager, _ = sample(policy, "eager", ids, mask, greedy=True)
    policy.decoder = Decoder("auto")
    compiled = policy.sample(ids, mask, greedy=True)
    assert policy.decoder.last_path == "compiled", policy.decoder.compile_error
    assert torch.equal(eager["tokens"], compiled["tokens"])
    torch.testing.assert_close(eager["token_log_probs"], compiled["token_log_probs"], atol=1e-4, rtol=0)
    drawn = policy.sample(ids, mask, torch.Generator(device="cuda").manual_seed(0))
    log_probs, _ = policy.log_probs(ids, mask, drawn["tokens"], drawn["token_mask"])
    assert (log_probs - drawn["token_log_probs"]).abs().max() < 1e-4
