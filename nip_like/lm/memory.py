"""The memory of LM agents: a preflight before a run starts, and the automatic token budget of its updates.

:func:`check_lm_memory` refuses, in one line and before any work, sizes that
cannot fit: the weights of every agent's model, plus the larger of

* sampling: the KV cache of a batch (``max(trainer.num_envs,
  trainer.test_batch_episodes)`` sequences of ``max_new_tokens`` tokens, the
  prompt not counted) and the logits of its last position;
* the update: each agent's gradients and optimiser state, and the activations
  (:func:`activation_estimate`) of one micro-batch of the agent's token
  budget, and the float32 logits of its message positions
  (:func:`logits_estimate`: :data:`LOGIT_COPIES` tensors of their size), or of
  one chunk of at most :data:`~nip_like.lm.teacher_forcing.AUTO_CHUNK_BYTES` when the
  agent scores in chunks (``score_chunk_tokens``: automatic unless its weights
  are sharded, or a number);

against the memory available on the run's device: free memory on CUDA
(``torch.cuda.mem_get_info``), ``MemAvailable`` of ``/proc/meminfo`` on the
CPU, at most ``run.memory_limit_gib``.

Once the agents are built, :func:`activation_bytes_per_token` measures what a
token of an update pass really keeps, and :func:`automatic_budget` turns the
memory then free into each agent's ``max_tokens_per_micro_batch`` when the
config leaves it null (the trainer logs it as ``lm/memory/<agent>/budget_tokens``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

from nip_like.errors import ConfigError
from nip_like.lm.teacher_forcing import AUTO_CHUNK_BYTES
from nip_like.lm.shared_models import base_owners, policy_owners
from nip_like.lm.sharding import is_sharded

GIB = 1024**3
#: Bytes of one element of each parameter dtype an agent may use.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a causal LM that its memory depends on."""

    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # 0 when unknown (the token view's alphabet): no logits counted
    num_heads: int = 0  # query heads; 0: hidden_size // head_dim (queries as wide as the hidden state)
    mlp_matrices: int = 3  # 3 for a gated MLP (Llama, Qwen2, Gemma), 2 for GPT-2's

    @property
    def query_width(self) -> int:
        """Width of the queries (and of the attention's output): heads times ``head_dim``, which need not be the hidden size (Gemma 3 270M: 4 x 256 = 1024 against 640)."""
        return self.num_heads * self.head_dim if self.num_heads else self.hidden_size

    @property
    def parameters(self) -> int:
        """Parameters of a Llama-like model of this shape (embeddings tied; norms and biases left out, a lower bound)."""
        hidden, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * hidden * self.query_width + 2 * hidden * kv  # q and o, k and v
        mlp = self.mlp_matrices * hidden * self.intermediate_size
        return self.vocab_size * hidden + self.num_layers * (attention + mlp)

    def kv_cache_bytes(self, sequences: int, tokens: int, element_bytes: int) -> int:
        """Bytes of the keys and values of ``sequences`` sequences of ``tokens`` tokens."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * sequences * tokens * element_bytes


def size(nbytes: float) -> str:
    """``nbytes`` for a message: GiB with one decimal from 0.1 GiB on, else MiB."""
    return f"{nbytes / GIB:.1f} GiB" if abs(nbytes) >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def shape_of_folder(path: str | Path) -> ModelShape:
    """The shape read from a model folder's ``config.json`` (Llama, Qwen2, GPT-2 names)."""
    config = json.loads((Path(path).expanduser() / "config.json").read_text())
    config = config.get("text_config", config)
    hidden = int(config.get("hidden_size") or config.get("n_embd"))
    heads = int(config.get("num_attention_heads") or config.get("n_head"))
    return ModelShape(
        num_layers=int(config.get("num_hidden_layers") or config.get("n_layer")),
        hidden_size=hidden,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden),
        vocab_size=int(config.get("vocab_size") or 0),
        num_heads=heads,
        mlp_matrices=2 if config.get("model_type") == "gpt2" or "n_embd" in config else 3,
    )


def shape_of_agent(agent, vocab_size: int = 0) -> ModelShape:
    """The shape of an :class:`~nip_like.lm.models.LMAgentConfig`'s model: its folder's, else its from-config sizes."""
    if agent.pretrained_path is not None:
        return shape_of_folder(agent.pretrained_path)
    heads = int(agent.num_heads)
    return ModelShape(
        num_layers=int(agent.num_layers),
        hidden_size=int(agent.hidden_size),
        num_kv_heads=heads,
        head_dim=int(agent.hidden_size) // heads,
        intermediate_size=int(agent.intermediate_size),
        vocab_size=int(vocab_size),
        num_heads=heads,
        mlp_matrices=2 if str(getattr(agent, "architecture", "llama")) == "gpt2" else 3,
    )


def available_memory(device: torch.device | str, limit_gib: Optional[float] = None, held: int = 0) -> Optional[tuple[int, str]]:
    """Bytes free for the run on ``device`` and where the figure comes from; None when it cannot be told.

    ``limit_gib`` (``run.memory_limit_gib``) caps the figure: the run may use
    no more than that in all, of which it already holds ``held`` bytes (its
    weights, once built).
    """
    device = torch.device(device)
    if limit_gib is not None:
        found = available_memory(device)
        limit = int(float(limit_gib) * GIB) - held
        if found is None or found[0] > limit:
            return max(limit, 0), f"run.memory_limit_gib={float(limit_gib):g}"
        return found
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable of the CPU"
        except OSError:
            return None
    return None


def activation_estimate(shape: ModelShape, element_bytes: int, checkpointing: bool, lora: bool = False) -> int:
    """Bytes a token of a scoring pass keeps for the backward pass, estimated from the model's shape (before it exists).

    Per block a Llama-like layer keeps about ``10 x hidden + 5 x MLP width``
    elements a token (norm inputs, projections, attention output, the MLP's
    gate, up, activation and product); with gradient checkpointing only each
    block's input, plus one block recomputed at a time. With LoRA (``lora``)
    the frozen projections compute no weight gradient, so they keep no input
    of their own: the MLP's input (the normed hidden state), the down
    projection's (the gated product) and the output projection's (the
    attention's output, :attr:`ModelShape.query_width` wide) are not kept;
    on Gemma 3 270M this gives 0.89 MiB a token against the 0.92 MiB that the
    probe measures (1.14 MiB without it). The probe of
    :func:`activation_bytes_per_token` measures the real figure once the
    model is built.
    """
    block = 10 * shape.hidden_size + 5 * shape.intermediate_size
    if lora:
        block -= shape.hidden_size + shape.intermediate_size + shape.query_width
    if checkpointing:
        return (shape.num_layers * shape.hidden_size + block) * element_bytes
    return shape.num_layers * block * element_bytes


#: Vocabulary-sized float32 tensors a scored position holds at the peak of an update: the logits, their copy with
#: the banned tokens masked, the log-softmax, the probabilities of the entropy, and in the backward pass a gradient
#: of that size. Measured on Gemma 3 270M (262,144 tokens; scripts/real_model_memory.py, LoRA): 4.4 to 6.2 times a
#: chunk's logits beyond the model's activations, in two runs.
LOGIT_COPIES = 5


def logits_estimate(vocab_size: int, positions: int, chunked: bool) -> int:
    """Bytes of the vocabulary-sized tensors of ``positions`` scored positions (:data:`LOGIT_COPIES` float32 copies).

    Scored in chunks (:func:`~nip_like.lm.teacher_forcing.chunked_scores`), one
    chunk's logits of at most :data:`~nip_like.lm.teacher_forcing.AUTO_CHUNK_BYTES`
    are alive at a time, whatever the number of positions.
    """
    logits = 4 * vocab_size * positions
    if chunked:
        logits = min(logits, AUTO_CHUNK_BYTES)
    return LOGIT_COPIES * logits


def lora_parameters(shape: ModelShape, rank: int) -> int:
    """Parameters of rank-``rank`` adapters on every attention and MLP projection of every block (an upper bound)."""
    hidden, mlp, kv, query = shape.hidden_size, shape.intermediate_size, shape.num_kv_heads * shape.head_dim, shape.query_width
    per_block = rank * (2 * (hidden + query) + 2 * (hidden + kv) + 3 * (hidden + mlp))
    return shape.num_layers * per_block


@dataclass(frozen=True)
class MemoryEstimate:
    """The parts of one agent's estimated peak, in bytes (see :func:`estimate_lm_memory`)."""

    weights: int  # the weights of every agent on the device (a shared base once)
    state: int  # gradients and optimiser state of every agent that trains
    activations: int  # what one micro-batch keeps for the backward pass
    logits: int  # float32 logits of one micro-batch's message positions or of one chunk (logits_estimate)
    sampling: int  # KV cache of a sampling batch plus its last position's logits
    kv_cache: int  # the KV cache alone (part of ``sampling``)
    scored: int  # tokens of the micro-batch the activations are counted for
    per_token: int  # activation bytes a token (:func:`activation_estimate`)

    @property
    def update(self) -> int:
        """The update's part beyond the weights: state, activations and logits."""
        return self.state + self.activations + self.logits

    @property
    def needed(self) -> int:
        """The estimated peak: the weights plus the larger of sampling and the update."""
        return self.weights + max(self.sampling, self.update)


def estimate_lm_memory(
    agents: Mapping[str, tuple[str, object, int]],
    sampling_batch: int,
    minibatch_size: int,
    autocast_dtype: Optional[str] = None,
    sharded: bool = False,
) -> dict[str, MemoryEstimate]:
    """The estimated peak of each LM agent, in parts: the arithmetic of :func:`check_lm_memory`.

    Parameters are those of :func:`check_lm_memory`. A frozen co-player only
    samples: its update part is zero.

    Returns
    -------
    dict of str to MemoryEstimate
        Each agent's name -> its estimate.
    """
    shapes = {name: shape_of_agent(agent, vocab_size) for name, (_, agent, vocab_size) in agents.items()}
    owners = base_owners({name: agent for name, (_, agent, _) in agents.items()})
    # A base shared by several agents (share_base_with) is held once.
    weights = sum(
        shapes[name].parameters * DTYPE_BYTES.get(str(agent.dtype), 4) for name, (_, agent, _) in agents.items() if owners[name] == name
    )
    ranks = {name: int(getattr(getattr(agent, "lora", None), "r", 0) or 0) for name, (_, agent, _) in agents.items()}
    players = policy_owners({name: agent for name, (_, agent, _) in agents.items()})
    frozen = {name for name, (_, agent, _) in agents.items() if getattr(agent, "frozen_from", None)}
    state = sum(  # a model that plays several roles (share_policy_with) trains once; a frozen co-player never
        12 * (lora_parameters(shapes[name], ranks[name]) if ranks[name] else shapes[name].parameters)
        for name in agents
        if players[name] == name and name not in frozen
    )
    estimates = {}
    for name, (_, agent, _) in agents.items():
        shape, tokens = shapes[name], int(agent.max_new_tokens)
        element = 2 if autocast_dtype or str(agent.dtype) == "bfloat16" else DTYPE_BYTES.get(str(agent.dtype), 4)
        kv_cache = shape.kv_cache_bytes(sampling_batch, tokens, DTYPE_BYTES.get(str(agent.dtype), 4))
        budget = agent.max_tokens_per_micro_batch
        scored = int(budget) if budget else (2 * tokens if budget is None else minibatch_size * tokens)
        per_token = activation_estimate(shape, element, bool(getattr(agent, "gradient_checkpointing", False)), lora=bool(ranks[name]))
        # The message positions of one micro-batch: a budget's tokens hold prompts too, and a micro-batch holds at
        # most a minibatch of rows of at most max_new_tokens message tokens; the automatic budget starts from one row.
        positions = min(scored, minibatch_size * tokens) if budget else minibatch_size * tokens if budget == 0 else tokens
        chunks = getattr(agent, "score_chunk_tokens", 0)  # an agent without the option keeps its logits whole
        chunked = bool(chunks) or (chunks is None and not sharded)  # one chunk's logits at a time (the automatic size's bound)
        logits = logits_estimate(shape.vocab_size, positions, chunked)
        trains = name not in frozen  # a frozen co-player only samples
        estimates[name] = MemoryEstimate(
            weights=weights,
            state=state if trains else 0,
            activations=per_token * scored if trains else 0,
            logits=logits if trains else 0,
            sampling=kv_cache + sampling_batch * shape.vocab_size * 4,
            kv_cache=kv_cache,
            scored=scored,
            per_token=per_token,
        )
    return estimates


def check_lm_memory(
    agents: Mapping[str, tuple[str, object, int]],
    sampling_batch: int,
    minibatch_size: int,
    device: torch.device | str,
    batch_fields: str = "trainer.num_envs / trainer.test_batch_episodes",
    autocast_dtype: Optional[str] = None,
    limit_gib: Optional[float] = None,
    sharded: bool = False,
) -> None:
    """Refuse, in one line, LM agents whose memory clearly cannot fit (see the module docstring).

    The update's peak is estimated whole (:func:`estimate_lm_memory`): the
    weights of every agent on the device (a base that agents share counted
    once), each agent's gradients and optimiser state (float32, Adam's two
    moments) for its trainable parameters (the adapters with LoRA), and the
    activations and logits of one micro-batch (its budget's tokens, at
    :func:`activation_estimate` bytes a token; the automatic budget starts
    from one row of ``2 x max_new_tokens`` tokens and grows to what is free).

    Parameters
    ----------
    agents : mapping of str to (str, LMAgentConfig, int)
        Each agent's name -> (the config path its settings come from, its
        config, the vocabulary of its model if built from config; 0: unknown,
        no logits counted).
    sampling_batch : int
        Sequences sampled at once.
    minibatch_size : int
        Sequences of one scoring pass when an agent has no token budget.
    device : torch.device or str
        The run's device.
    batch_fields : str
        The options that set ``sampling_batch``, for the message.
    autocast_dtype : str, optional
        ``run.autocast_dtype``: activations of two bytes an element.
    limit_gib : float, optional
        ``run.memory_limit_gib``: plan for no more than this.
    sharded : bool
        ``run.fsdp``: the agents' weights are sharded, so automatic chunked scoring is off.

    Raises
    ------
    ConfigError
        Naming the agent, the estimate and its parts, the memory available and the settings that would lower it.
    """
    available = available_memory(device, limit_gib)
    if available is None:
        return
    free, source = available
    estimates = estimate_lm_memory(agents, sampling_batch, minibatch_size, autocast_dtype, sharded)
    for name, (where, agent, _) in agents.items():
        estimate, tokens = estimates[name], int(agent.max_new_tokens)
        if estimate.needed <= free:
            continue
        weights, scored, per_token, logits = estimate.weights, estimate.scored, estimate.per_token, estimate.logits
        lora_rank = int(getattr(getattr(agent, "lora", None), "r", 0) or 0)
        budget, chunks = agent.max_tokens_per_micro_batch, getattr(agent, "score_chunk_tokens", 0)
        if estimate.sampling >= estimate.update:
            part = f"KV cache {size(estimate.kv_cache)} of {sampling_batch} sequences of {tokens} tokens"
            advice = f"{where}.max_new_tokens ({tokens}) or {batch_fields}"
        else:
            part = (
                f"gradients and optimiser state {size(estimate.state)}, activations {size(per_token * scored)} "
                f"of {scored} tokens at {per_token / 2**20:.2f} MiB a token, logits {size(logits)}"
            )
            settings = [] if lora_rank else [f"{where}.lora.r (adapters instead of every weight)"]
            if budget:
                settings.append(f"{where}.max_tokens_per_micro_batch ({budget})")
            elif budget == 0:
                settings.append(f"{where}.max_tokens_per_micro_batch (0: the whole minibatch of {minibatch_size}; null: automatic)")
            if not getattr(agent, "gradient_checkpointing", False):
                settings.append(f"{where}.gradient_checkpointing=true")
            if not autocast_dtype:
                settings.append("run.autocast_dtype=bfloat16")
            if chunks == 0 and hasattr(agent, "score_chunk_tokens"):
                settings.append(f"{where}.score_chunk_tokens (0: all logits at once; null: automatic chunks)")
            advice = ", ".join(settings) or f"the model's size ({where}.pretrained_path)"
        if weights > free:  # nothing else can help
            advice = f"the models' sizes ({where}.pretrained_path, hidden_size, num_layers, vocab_size)"
        raise ConfigError(
            f"{where}: agent {name} cannot fit in memory: it needs at least {size(estimate.needed)} (weights of the agents "
            f"{size(weights)}, {part}), but {size(free)} is available ({source}); lower {advice}"
        )


#: Share of the memory left after weights, gradients and optimiser state that the automatic token budget fills.
BUDGET_SHARE = 0.5
#: The automatic budget is at most this many tokens: beyond it a pass is long enough to keep a device busy.
MAX_BUDGET = 65536
#: Tokens of the probe pass that measures an agent's activation bytes per token.
PROBE_TOKENS = 128


def activation_bytes_per_token(policy, autocast_dtype: Optional[str] = None, tokens: int = PROBE_TOKENS) -> float:
    """Bytes that one token of a scoring pass with gradients keeps for the backward pass, measured.

    One teacher-forced pass of ``policy`` (an :class:`~nip_like.lm.policy.LMPolicy`)
    over a probe row of ``tokens`` tokens (half prompt, half message), in
    train mode and under the run's autocast, with gradients; the tensors it
    saves for the backward pass are counted once per storage. No backward
    pass runs and nothing is kept. The count holds what the model's options
    make of it: LoRA (frozen weights save less), gradient checkpointing
    (only the blocks' inputs), bfloat16, the logits of the message. The
    parameters and buffers that layers save (a linear layer's weight) are
    left out: they are held anyway.

    Returns
    -------
    float
        Saved bytes divided by ``tokens``; 0 for a policy without trainable parameters.
    """
    from nip_like.lm.policy import in_mode, model_device

    if not any(p.requires_grad for p in policy.parameters()):
        return 0.0
    device = model_device(policy.model)
    half = max(tokens // 2, 1)
    token = int(policy.eos_token_id)
    prompt = torch.full((1, half), token, dtype=torch.long, device=device)
    message = torch.full((1, half), token, dtype=torch.long, device=device)
    seen: dict[tuple, int] = {}
    # The weights that linear layers save for their input's gradient are held anyway: not activations.
    held = {(t.untyped_storage().data_ptr(), t.device.index) for t in (*policy.parameters(), *policy.buffers())}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved = tensor.detach()  # never the tensor itself: a saved output would hold its own graph node (a leak)
        key = (saved.untyped_storage().data_ptr(), saved.device.index)
        if saved.device.type == device.type and key not in held:
            seen[key] = saved.untyped_storage().nbytes()
        return saved

    autocast = torch.autocast(device.type, dtype=getattr(torch, autocast_dtype or "bfloat16"), enabled=bool(autocast_dtype))
    with in_mode(policy, training=True), torch.enable_grad(), autocast:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            policy.evaluate(prompt, torch.ones_like(prompt, dtype=torch.bool), message, torch.ones_like(message, dtype=torch.bool), recompute=False)
    return sum(seen.values()) / (2 * half)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes that ``tensor`` takes on this rank: a sharded parameter's (DTensor's) local shard, else all of it."""
    local = tensor.to_local() if is_sharded(tensor) else tensor
    return local.numel() * local.element_size()


def trainable_bytes(policy) -> int:
    """Bytes of the update's state per trainable parameter on this rank: its gradient and Adam's two moments (float32)."""
    return sum(local_bytes(p) // p.element_size() for p in policy.parameters() if p.requires_grad) * 3 * 4


def memory_tokens(per_token: float, free: int, reserved: int) -> Optional[int]:
    """Tokens of activations that :data:`BUDGET_SHARE` of what ``free`` leaves after ``reserved`` holds (0: nothing left; None: no limit, a policy that keeps nothing)."""
    if per_token <= 0:
        return None
    return int(max(free - reserved, 0) * BUDGET_SHARE / per_token)


def automatic_budget(per_token: float, free: int, reserved: int) -> int:
    """The token budget of one micro-batch: :func:`memory_tokens`, at most :data:`MAX_BUDGET` (0: nothing left)."""
    held = memory_tokens(per_token, free, reserved)
    return MAX_BUDGET if held is None else min(MAX_BUDGET, held)
