"""The memory preflight of LM agents (:mod:`nip_like.lm.memory`): a lower bound, refused only when clearly too large."""

from __future__ import annotations

import pytest
import torch

import nip_like.lm.memory as memory
from nip_like.errors import ConfigError
from nip_like.lm.memory import LOGIT_COPIES, GIB, activation_estimate, ModelShape, available_memory, check_lm_memory, estimate_lm_memory, shape_of_folder
from nip_like.lm.lora import LoraOptions
from nip_like.lm.models import LMAgentConfig
from tests.lm_folders import chat_model  # noqa: F401 - the fixture

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_kv_heads=4, head_dim=16, intermediate_size=128, vocab_size=0)


def agents(**settings) -> dict:
    return {"prover": ("scenario.default_agent", LMAgentConfig(**settings), 0)}


def test_the_kv_cache_is_keys_and_values_of_every_layer_head_and_token():
    # 2 (k, v) x 2 layers x 4 heads x 16 dims x 10 sequences x 100 tokens x 4 bytes
    assert SHAPE.kv_cache_bytes(10, 100, 4) == 2 * 2 * 4 * 16 * 10 * 100 * 4


def test_a_batch_is_refused_just_above_the_memory_and_passes_just_below(monkeypatch):
    needed = SHAPE.kv_cache_bytes(1000, 500, 4) + SHAPE.parameters * 4
    monkeypatch.setattr(memory, "available_memory", lambda device, limit=None: (needed, "a test budget"))
    check_lm_memory(agents(max_new_tokens=500), 1000, 8, "cpu")
    with pytest.raises(ConfigError) as error:
        check_lm_memory(agents(max_new_tokens=501), 1000, 8, "cpu")
    message = str(error.value)
    assert "\n" not in message and message.startswith("scenario.default_agent: agent prover cannot fit in memory")
    assert "KV cache" in message and "(a test budget)" in message and "lower scenario.default_agent.max_new_tokens (501)" in message


def test_the_logits_count_the_message_positions_of_one_micro_batch_five_times():
    """The real vocabulary (262,144 tokens: 1 MiB of float32 logits a position): only message positions have logits."""
    vocab, position = 262_144, 4 * 262_144

    def logits(minibatch: int = 4, sharded: bool = False, **settings) -> int:
        agent = {"prover": ("scenario.default_agent", LMAgentConfig(max_new_tokens=16, **settings), vocab)}
        return estimate_lm_memory(agent, 4, minibatch, sharded=sharded)["prover"].logits

    assert LOGIT_COPIES == 5
    # A budget of 4 rows of 64 prompt and 16 message tokens: 64 positions have logits, not 320.
    assert logits(max_tokens_per_micro_batch=320, score_chunk_tokens=0) == 5 * 64 * position
    assert logits(max_tokens_per_micro_batch=320) == 5 * 64 * position  # 64 MiB: within one chunk
    # The automatic budget starts from one row; 0 is the whole minibatch.
    assert logits() == 5 * 16 * position
    assert logits(max_tokens_per_micro_batch=0, score_chunk_tokens=0) == 5 * 4 * 16 * position
    # 64 rows of 16 positions: 1 GiB of logits, scored 256 MiB at a time unless the weights are sharded.
    assert logits(64, max_tokens_per_micro_batch=10**6) == 5 * 2**28
    assert logits(64, sharded=True, max_tokens_per_micro_batch=10**6) == 5 * GIB


def test_a_refusal_names_the_logits_and_the_chunking(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device, limit=None: (GIB, "a test budget"))
    whole = {"prover": ("scenario.default_agent", LMAgentConfig(max_tokens_per_micro_batch=10**6, score_chunk_tokens=0), 50_000)}
    # 64 rows of 8 positions x 50,000 float32 logits, five times: 0.5 GiB.
    with pytest.raises(ConfigError, match=r"logits 0\.5 GiB.*lower .*max_tokens_per_micro_batch \(1000000\).*score_chunk_tokens \(0: "):
        check_lm_memory(whole, 4, 64, "cpu")
    chunked = {"prover": ("scenario.default_agent", LMAgentConfig(max_tokens_per_micro_batch=10**6), 50_000)}
    with pytest.raises(ConfigError, match=r"logits 0\.5 GiB\)"):  # 97.7 MiB: one chunk
        check_lm_memory(chunked, 4, 64, "cpu")


def test_the_parameters_of_gemma_3_270m_its_queries_wider_than_its_hidden_state():
    """4 query heads of 256 (1024 wide) on a 640-wide model, one KV head, a gated MLP: 268,042,240 (norms left out)."""
    gemma = ModelShape(num_layers=18, hidden_size=640, num_kv_heads=1, head_dim=256, intermediate_size=2048,
                       vocab_size=262_144, num_heads=4)
    assert gemma.query_width == 1024
    assert gemma.parameters == 262_144 * 640 + 18 * (2 * 640 * 1024 + 2 * 640 * 256 + 3 * 640 * 2048) == 268_042_240
    # The real model reports 268,098,176 parameters: the 55,936 left are its norms.
    assert 0 < 268_098_176 - gemma.parameters < 0.001 * gemma.parameters


def test_with_lora_the_frozen_projections_inputs_are_not_counted():
    """Gemma 3 270M's shape: the MLP's input (640), the gated product (2048) and the attention's output (1024) go."""
    gemma = ModelShape(num_layers=18, hidden_size=640, num_kv_heads=1, head_dim=256, intermediate_size=2048,
                       vocab_size=262_144, num_heads=4)
    full = 18 * (10 * 640 + 5 * 2048) * 4
    assert activation_estimate(gemma, 4, False) == full
    assert activation_estimate(gemma, 4, False, lora=True) == full - 18 * (640 + 2048 + 1024) * 4
    assert activation_estimate(gemma, 2, True, lora=True) == (18 * 640 + 10 * 640 + 5 * 2048 - 640 - 2048 - 1024) * 2
    # The preflight uses it for an agent with adapters.
    agent = {"prover": ("scenario.default_agent", LMAgentConfig(lora=LoraOptions(r=8), hidden_size=640, num_layers=18,
                                                                 num_heads=4, intermediate_size=2048), 1000)}
    assert estimate_lm_memory(agent, 4, 4)["prover"].per_token == activation_estimate(
        ModelShape(18, 640, 4, 160, 2048, 1000, num_heads=4), 4, False, lora=True)


@pytest.mark.parametrize("family", ["qwen2", "llama", "gpt2"])
def test_a_folders_parameters_are_a_lower_bound_tight_for_llama_like_models(chat_model, family):
    from transformers import AutoModelForCausalLM

    folder = chat_model(family)
    counted = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
    estimated = shape_of_folder(folder).parameters
    assert estimated <= counted
    if family != "gpt2":  # GPT-2's learned position embeddings and biases are left out
        assert estimated >= 0.95 * counted, (estimated, counted)


def test_unknown_memory_checks_nothing(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device, limit=None: None)
    check_lm_memory(agents(max_new_tokens=10**6), 10**6, 8, "cpu")


def test_the_cpu_figure_is_memavailable():
    free, source = available_memory("cpu")
    assert free > 0 and "MemAvailable" in source


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_figure_is_the_free_memory():
    free, source = available_memory("cuda")
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory and "free on cuda" in source


def test_a_folders_shape_is_read_from_its_config(chat_model):
    shape = shape_of_folder(chat_model("qwen2"))
    assert shape.num_layers >= 1 and shape.head_dim * shape.num_kv_heads <= shape.hidden_size and shape.vocab_size > 0


def test_the_whole_update_counts_and_the_refusal_names_what_would_lower_it(monkeypatch):
    """Full fine-tuning of a 24-block model with a large budget: gradients, Adam's moments and activations, one line."""
    shape = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "intermediate_size": 4864}
    full = {"prover": ("scenario.default_agent", LMAgentConfig(max_tokens_per_micro_batch=60_000, **shape), 8000)}
    monkeypatch.setattr(memory, "available_memory", lambda device, limit=None: (40 * GIB, "a test budget"))
    with pytest.raises(ConfigError) as error:
        check_lm_memory(full, 8, 256, "cuda")
    message = str(error.value)
    assert "\n" not in message and "gradients and optimiser state" in message and "activations" in message
    for setting in ("lora.r", "max_tokens_per_micro_batch (60000)", "gradient_checkpointing=true", "run.autocast_dtype=bfloat16"):
        assert setting in message, setting
    # The same with those settings fits.
    lora = LMAgentConfig(max_tokens_per_micro_batch=8192, gradient_checkpointing=True, lora=LoraOptions(r=16), **shape)
    check_lm_memory({"prover": ("scenario.default_agent", lora, 8000)}, 8, 256, "cuda", autocast_dtype="bfloat16")


def test_a_memory_limit_caps_what_the_preflight_sees():
    free, source = available_memory("cpu", limit_gib=0.5)
    assert free == GIB // 2 and source == "run.memory_limit_gib=0.5"
    free, source = available_memory("cpu", limit_gib=10**6)
    assert "MemAvailable" in source
    with pytest.raises(ConfigError, match=r"run\.memory_limit_gib=0\.001"):
        check_lm_memory(agents(hidden_size=256, num_layers=4, intermediate_size=512), 64, 8, "cpu", limit_gib=0.001)


def test_the_probe_measures_what_checkpointing_lora_and_bfloat16_save(chat_model):
    from nip_like.lm.memory import activation_bytes_per_token
    from nip_like.lm.models import build_lm_policy

    folder = str(chat_model("qwen2"))
    plain = activation_bytes_per_token(build_lm_policy(LMAgentConfig(pretrained_path=folder)))
    checkpointed = activation_bytes_per_token(build_lm_policy(LMAgentConfig(pretrained_path=folder, gradient_checkpointing=True)))
    halved = activation_bytes_per_token(build_lm_policy(LMAgentConfig(pretrained_path=folder)), "bfloat16")
    assert 0 < checkpointed < plain and 0 < halved < plain
    frozen = build_lm_policy(LMAgentConfig(pretrained_path=folder)).requires_grad_(False)
    assert activation_bytes_per_token(frozen) == 0.0


def test_by_default_an_update_pass_keeps_no_logits_over_the_vocabulary(chat_model):
    """The default scores in chunks, recomputing the logits in the backward pass: the log-softmax is not kept.

    The probe row is half message, so the log-softmax over the vocabulary alone
    is two float32 per vocabulary entry per token of the row.
    """
    from nip_like.lm.memory import activation_bytes_per_token
    from nip_like.lm.models import build_lm_policy

    folder = str(chat_model("qwen2"))
    default = build_lm_policy(LMAgentConfig(pretrained_path=folder))
    whole = build_lm_policy(LMAgentConfig(pretrained_path=folder, score_chunk_tokens=0))
    vocab = default.banned.shape[0]
    assert default.scoring_chunks() == "auto" and whole.scoring_chunks() is None
    saved_default, saved_whole = activation_bytes_per_token(default), activation_bytes_per_token(whole)
    assert saved_whole - saved_default >= 4 * vocab, (saved_default, saved_whole, vocab)
    default.sharded = True  # FSDP2 (nip_like.lm.sharding): the output layer cannot run apart from the forward pass
    assert default.scoring_chunks() is None


def _peak_bytes_while(action) -> int:
    """Peak tensor memory allocated while ``action()`` runs, over what was held before (the CPU profiler's events)."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with profiler:
        action()
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.slow
def test_a_memory_limit_shrinks_the_automatic_budget_and_the_run_stays_under_it(chat_model, tmp_path):
    from nip_like.experiment import build_trainer
    from nip_like.lm.memory import automatic_budget, memory_tokens, trainable_bytes
    from tests.test_lm_chat import chat_config

    folder = chat_model("qwen2")
    sizes = ("trainer.num_envs=8", "trainer.frames_per_batch=32", "trainer.minibatch_size=32", "trainer.num_epochs=1")
    free = build_trainer(chat_config(folder, tmp_path, *sizes), tmp_path / "free")
    per_token = free.memory_metrics["lm/memory/prover/activation_bytes_per_token"]
    # What the trainer counts as held: every parameter and buffer (the policies' banned-token masks are a few KB).
    held = sum(t.numel() * t.element_size() for t in (*free.policy.parameters(), *free.policy.buffers()))
    # A limit that leaves the update room for a few rows of activations only.
    limit = held + int(per_token * 3000)
    limited = build_trainer(chat_config(folder, tmp_path, *sizes, f"run.memory_limit_gib={limit / GIB}"), tmp_path / "limited")
    budget = limited.memory_metrics["lm/memory/prover/budget_tokens"]
    reserved = sum(trainable_bytes(limited.policy.policy(name)) for name in limited.agent_names)
    assert budget < free.memory_metrics["lm/memory/prover/budget_tokens"]
    assert budget == automatic_budget(per_token, limit - held, reserved) > 0
    assert limited.policy.policy("prover").max_tokens_per_micro_batch == budget
    # What the graph may hold across micro-batches: the same memory, not capped at one pass's size.
    assert limited.policy.policy("prover").max_tokens_held == memory_tokens(per_token, limit - held, reserved) >= budget
    assert free.policy.policy("prover").max_tokens_held >= free.policy.policy("prover").max_tokens_per_micro_batch
    peak = _peak_bytes_while(limited.train)
    assert peak <= limit - held, (peak, limit - held)
    # Room for less than one row of activations: refused when the budget is set, in one line naming what to change.
    width = limited.train_env.prompt_length + limited.policy.message_tokens
    short = chat_config(folder, tmp_path, *sizes, f"run.memory_limit_gib={(held + reserved + per_token * width) / GIB}")
    with pytest.raises(ConfigError, match=r"agent prover's update cannot fit in memory: .*under one row \(\d+\); lower") as error:
        build_trainer(short, tmp_path / "short")
    assert "\n" not in str(error.value)
    # Below the weights the preflight refuses before anything is built.
    tight = chat_config(folder, tmp_path, *sizes, f"run.memory_limit_gib={(held + per_token * 20) / GIB}")
    with pytest.raises(ConfigError, match=r"agent \w+ cannot fit in memory: .*\(run\.memory_limit_gib=") as error:
        build_trainer(tight, tmp_path / "tight")
    assert "\n" not in str(error.value)


def test_the_probe_counts_activations_not_the_weights_layers_save(chat_model):
    """A linear layer saves its weight for its input's gradient: held anyway, so not an activation of the update."""
    from nip_like.lm.memory import activation_bytes_per_token
    from nip_like.lm.models import build_lm_policy

    policy = build_lm_policy(LMAgentConfig(pretrained_path=str(chat_model("qwen2"))))
    # Activations grow with the tokens, the weights do not: counted, they would make the figure per token fall.
    short, long = activation_bytes_per_token(policy, tokens=128), activation_bytes_per_token(policy, tokens=512)
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    assert weights / 128 - weights / 512 > 0.1 * short  # what counting the weights would add at 128 tokens
    assert abs(short - long) < 0.05 * short, (short, long)
