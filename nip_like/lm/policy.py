"""A causal language model as a policy: sample messages, score them, value them.

:class:`LMPolicy` wraps a Hugging Face causal LM and its tokenizer. It samples
a message token by token with the KV cache (:meth:`LMPolicy.sample`), and
recomputes the same log-probabilities with gradients in one teacher-forced
pass (:meth:`LMPolicy.log_probs`), so that the PPO ratio is exactly 1 on the
first epoch. Everything is dense and padded:

* prompts ``(B, P)`` with a boolean mask, padded on the left (any layout of
  the mask works: positions are counted over the real tokens only);
* messages ``(B, T)`` with ``T = max_new_tokens``: the sampled tokens, ``<eos>``
  included, then ``<pad>`` with mask False.

Position ids are ``mask.cumsum(-1) - 1`` clamped at 0 everywhere, so a
left-padded row gets the same logits as the same row unpadded.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from nip_like import interrupts
from nip_like.errors import ConfigError
from nip_like.lm.sampling import SamplingSettings, entropy, processed_log_probs
from nip_like.lm.value import LMValueHead


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row.

    Parameters
    ----------
    mask : torch.Tensor
        ``(B, L)`` attention mask (bool or 0/1).

    Returns
    -------
    torch.Tensor
        ``(B, L)`` long: ``mask.cumsum(-1) - 1`` clamped at 0 (padding
        before the first real token gets position 0).
    """
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes the KV cache: ``cache`` (transformers 5.24 on; ``past_key_values`` is deprecated there until 5.40) or ``past_key_values`` (4.56 to 5.23)."""
    return "cache" if "cache" in _forward_parameters(model) else "past_key_values"


def _forward_parameters(model: nn.Module) -> set[str]:
    """The keyword parameters of the transformers model's forward (under a peft wrapper, the base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (where the tensors built around it belong)."""
    return next(model.parameters()).device


@contextmanager
def in_mode(module: nn.Module, training: bool) -> Iterator[None]:
    """Run the block with ``module`` in train (``training``) or eval mode, then give every submodule back the mode it had.

    Sampling needs eval mode whatever the trainer's loop is in: transformers
    turns the KV cache off for a model in train mode with gradient
    checkpointing on (5.17 even under ``no_grad``), and dropout must not
    change a sampled distribution. The memory probe needs train mode (see
    :func:`~nip_like.lm.memory.activation_bytes_per_token`).
    """
    modes = [(child, child.training) for child in module.modules()]
    if all(mode == training for _, mode in modes):
        yield
        return
    module.train(training)
    try:
        yield
    finally:
        for child, training in modes:
            child.training = training


def trim_left_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading columns of left-padded ``(B, P)`` prompts that are padding in every row.

    Positions are counted over real tokens (:func:`position_ids`), so the
    model's outputs at the real tokens do not change; the pass gets shorter.
    """
    real_columns = mask.any(0)
    if not bool(real_columns.any()):
        return ids, mask
    first = int(real_columns.long().argmax())
    return ids[:, first:], mask[:, first:]


def trim_padding_columns(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop every column of ``(B, P)`` prompts that is padding in every row, but the last column.

    Besides the leading padding of left-padded prompts (:func:`trim_left_padding`),
    this drops the empty slots inside or at the end of fixed layouts (the
    token view's prompts: a prover that speaks first has 8 empty slots of 26).
    Positions are counted over real tokens and padding is never attended to,
    so the outputs at the remaining columns do not change (the teacher-forced
    scores come out bitwise equal on CPU); the pass gets shorter. The last
    column stays even where it is padding everywhere: its output predicts the
    message's first token.
    """
    keep = mask.any(0)
    if not bool(keep.any()):
        return ids, mask
    keep[-1] = True
    if bool(keep.all()):
        return ids, mask
    return ids[:, keep], mask[:, keep]


def micro_batches(lengths: torch.Tensor, width: int, budget: Optional[int]) -> list[torch.Tensor]:
    """Rows in groups whose padded size stays within a token budget, sorted by length.

    Parameters
    ----------
    lengths : torch.Tensor
        ``(B,)`` real tokens (prompt plus message) of each row.
    width : int
        Padded width of a row; a group of rows costs ``rows x longest row`` tokens.
    budget : int, optional
        Largest ``rows x longest row`` of a group; None: one group of all rows.

    Returns
    -------
    list of torch.Tensor
        Row indices of each group, rows of similar length together (shortest
        first), so that little of each pass is padding.

    Raises
    ------
    ValueError
        If one row alone is longer than the budget.
    """
    rows = lengths.shape[0]
    if budget is None or rows == 0:
        return [torch.arange(rows, device=lengths.device)]
    longest = int(lengths.max())
    if longest > budget:
        raise ValueError(
            f"max_tokens_per_micro_batch ({budget}) is below the longest sequence ({longest} tokens): "
            f"it must hold at least one prompt plus message"
        )
    order = lengths.argsort(stable=True).tolist()
    sorted_lengths = lengths[order].tolist()
    groups, start = [], 0
    for end in range(1, rows + 1):
        # Rows are sorted, so the group's longest row is its last one.
        if end == rows or (end + 1 - start) * sorted_lengths[end] > budget:
            groups.append(torch.tensor(order[start:end], device=lengths.device))
            start = end
    return groups


def _cache_of(output) -> object:
    """The KV cache a forward pass returned, under either of its names."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def sampled_messages(
    tokens: torch.Tensor, token_mask: torch.Tensor, token_log_probs: torch.Tensor, token_entropy: torch.Tensor, finished: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The dict of :meth:`LMPolicy.sample`: the messages, their scores, and the sums and counts derived from them."""
    return {
        "tokens": tokens,
        "token_mask": token_mask,
        "token_log_probs": token_log_probs,
        "token_entropy": token_entropy,
        "log_prob": token_log_probs.sum(-1),
        "num_tokens": token_mask.sum(-1),
        "finished": finished,
    }


class LMPolicy(nn.Module):
    """Sample, score and value messages of a causal language model.

    Parameters
    ----------
    model : PreTrainedModel
        A causal LM (``AutoModelForCausalLM``) whose vocabulary covers the
        tokenizer's. Its dropout should be 0 (as in Llama-family configs):
        otherwise scoring in train mode does not reproduce the sampling
        log-probabilities.
    tokenizer : PreTrainedTokenizerBase
        Its tokenizer; it must have a pad and an eos token, different from
        each other.
    max_new_tokens : int
        Length ``T`` of a message, ``<eos>`` included.
    temperature, top_k, top_p : float, int, float
        How the logits are processed before sampling (see
        :class:`~nip_like.lm.sampling.SamplingSettings`).
    value_head : LMValueHead, optional
        The value head used by :meth:`value`; None: the policy has no value.
    stop_strings : sequence of str
        A message also ends at the first token after which its text contains
        one of these (the token is kept, the rest is padding), as
        ``generate``'s ``stop_strings`` do.
    max_tokens_per_micro_batch : int, optional
        Token budget of one scoring pass with gradients (see
        :meth:`evaluate`); None scores every row in one pass.
    score_chunk_tokens : int, optional
        Score a message's tokens this many positions at a time: the model's
        last hidden states go through its output layer one chunk at a time,
        and each chunk's logits are recomputed in the backward pass instead
        of kept, so the float32 logits (``rows x T x vocabulary``, three
        times over) are never held whole. For models whose logits are their
        output embeddings applied to their last hidden state (checked once,
        on the first scoring pass); None computes all logits at once.
    deferred_lora : LoraOptions, optional
        LoRA adapters to add after the warm start (:meth:`after_warm_start`)
        instead of now.

    Notes
    -----
    The distribution sampled from, and scored by :meth:`log_probs`, is the
    model's next-token distribution with ``<pad>``, ``<bos>``, ``<unk>`` and
    the ids the tokenizer does not have banned (probability 0; the buffer
    ``banned`` lists them), so a message holds symbols and ``<eos>`` only; at
    the given temperature, restricted to the top-k tokens and then to the
    top-p nucleus (see :func:`~nip_like.lm.sampling.processed_log_probs`).
    So the stored log-probabilities are those of the behaviour policy itself,
    as PPO's importance ratio needs, and not of the raw model.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        value_head: Optional[LMValueHead] = None,
        stop_strings: Sequence[str] = (),
        max_tokens_per_micro_batch: Optional[int] = None,
        score_chunk_tokens: Optional[int] = None,
        deferred_lora: Optional[object] = None,
    ) -> None:
        super().__init__()
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer needs a pad token and an eos token")
        vocab_size = model.config.get_text_config().vocab_size
        if len(tokenizer) > vocab_size:
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model only {vocab_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.value_head = value_head
        self.max_new_tokens = max_new_tokens
        self.settings = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
        self.pad_token_id: int = tokenizer.pad_token_id
        self.eos_token_id: int = tokenizer.eos_token_id
        self.stop_strings = tuple(str(stop) for stop in stop_strings if stop)
        # A stop string spans at most as many tokens as it has characters (every token decodes to one or more).
        self._stop_window = max((len(stop) for stop in self.stop_strings), default=0) + 1
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ConfigError(f"max_tokens_per_micro_batch must be at least 1, got {max_tokens_per_micro_batch}")
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        if score_chunk_tokens is not None and score_chunk_tokens < 1:
            raise ConfigError(f"score_chunk_tokens must be at least 1, got {score_chunk_tokens}")
        self.score_chunk_tokens = score_chunk_tokens
        self._cache_argument = cache_argument(model)
        self._deferred_lora = deferred_lora
        self._keeps_logits = "logits_to_keep" in _forward_parameters(model)
        #: Real and padded tokens of the scoring passes since :meth:`pop_padding_counts` was last called.
        self._scored_tokens = [0, 0]
        #: Whether every rank must run this policy's model the same number of times (its FSDP2 update,
        #: :mod:`nip_like.lm.sharding`): :meth:`evaluate` then takes as many micro-batches as the rank with most.
        self.lockstep = False
        #: The agent whose base model this policy's model shares (:mod:`nip_like.lm.shared_models`); None: its own.
        self.base_owner: Optional[str] = None
        #: Whether the model's base weights are no longer its folder's: LoRA adapters added after a warm start that
        #: fitted every weight (``lora.warm_start: full``), so the agent's folder must hold the base too.
        self.fitted_base = False
        #: The agent whose model this policy plays with (``share_policy_with``); None: its own model.
        self.policy_owner: Optional[str] = None
        #: Where a frozen co-player's weights come from (:mod:`nip_like.lm.frozen`); None: a trained agent.
        self.frozen_source: Optional[object] = None
        device = model_device(model)
        banned = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        for token_id in (self.pad_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id):
            if token_id is not None and token_id != self.eos_token_id:
                banned[token_id] = True
        banned[len(tokenizer) :] = True
        # (vocab,) booleans on the model's device: the tokens that are never sampled.
        self.register_buffer("banned", banned, persistent=False)
        if score_chunk_tokens is not None:  # a model that cannot be scored in chunks is refused now, before any work
            with torch.no_grad():
                probe = model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False, output_hidden_states=True)
            self._check_chunking(probe)

    @torch.no_grad()
    def sample(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        greedy: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Sample one message per prompt, with the KV cache.

        Parameters
        ----------
        prompt_ids : torch.LongTensor
            ``(B, P)`` prompt tokens, padded (on the left) with anything.
        prompt_mask : torch.BoolTensor
            ``(B, P)``: True at real prompt tokens; each row needs one.
        generator : torch.Generator, optional
            Source of randomness: the same seed gives the same messages. A
            generator on another device than the prompts gets the
            probabilities copied to its device at each token.
        greedy : bool
            Take the most likely token of the processed distribution at each
            step instead of drawing one (evaluation); the log-probabilities
            returned are still those of that distribution.

        Returns
        -------
        dict of str to torch.Tensor
            On the prompts' device, with ``T = max_new_tokens``:

            * ``"tokens"`` ``(B, T)`` long: the sampled tokens, the first
              ``<eos>`` included; ``<pad>`` after it (mask False).
            * ``"token_mask"`` ``(B, T)`` bool: True at the sampled tokens
              (a prefix of each row).
            * ``"token_log_probs"`` ``(B, T)`` float32: each sampled token's
              log-probability under the processed distribution it was drawn
              from (temperature, top-k, top-p, bans applied); 0 where the
              mask is False.
            * ``"token_entropy"`` ``(B, T)`` float32: the entropy of that
              distribution at each sampled position; 0 where the mask is False.
            * ``"log_prob"`` ``(B,)``: their sum, the message's log-probability.
            * ``"num_tokens"`` ``(B,)`` long: the number of sampled tokens.
            * ``"finished"`` ``(B,)`` bool: the message ended with ``<eos>``
              or a stop string (False: cut at ``max_new_tokens``).
        """
        with in_mode(self.model, training=False):
            return self._sample(prompt_ids, prompt_mask, generator, greedy)

    def _sample(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generator: Optional[torch.Generator], greedy: bool
    ) -> dict[str, torch.Tensor]:
        """:meth:`sample`'s decoding loop (the model in eval mode)."""
        self._check_prompts(prompt_ids, prompt_mask)
        prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask)
        batch_size, device = prompt_ids.shape[0], prompt_ids.device
        length = self.max_new_tokens
        tokens = torch.full((batch_size, length), self.pad_token_id, dtype=torch.long, device=device)
        token_mask = torch.zeros((batch_size, length), dtype=torch.bool, device=device)
        token_log_probs = torch.zeros((batch_size, length), dtype=torch.float32, device=device)
        token_entropy = torch.zeros((batch_size, length), dtype=torch.float32, device=device)
        alive = torch.ones(batch_size, dtype=torch.bool, device=device)
        ended = torch.zeros(batch_size, dtype=torch.bool, device=device)

        attention_mask = prompt_mask.long()
        next_position = attention_mask.sum(-1, keepdim=True)
        # The prompt's pass needs the logits of its last position only (as generate's logits_to_keep=1).
        last_logits = {"logits_to_keep": 1} if self._keeps_logits else {}
        output = self.model(
            input_ids=prompt_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            use_cache=True,
            **last_logits,
        )
        for step in range(length):
            interrupts.raise_if_stop_requested("the sampled messages")  # a long decode stops at a signal too
            log_probs = processed_log_probs(output.logits[:, -1], self.banned, self.settings)
            token = log_probs.argmax(-1) if greedy else self._draw(log_probs, generator)
            token_log_prob = log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            tokens[:, step] = torch.where(alive, token, self.pad_token_id)
            token_mask[:, step] = alive
            token_log_probs[:, step] = torch.where(alive, token_log_prob, 0.0)
            token_entropy[:, step] = torch.where(alive, entropy(log_probs), 0.0)
            stopped = alive & (token == self.eos_token_id)
            if self.stop_strings:
                stopped = stopped | self._hit_stop_string(tokens[:, : step + 1], alive & ~stopped)
            ended = ended | stopped
            alive = alive & ~stopped
            if step == length - 1 or not bool(alive.any()):
                break
            attention_mask = torch.cat([attention_mask, token_mask[:, step : step + 1].long()], dim=-1)
            output = self.model(
                input_ids=tokens[:, step : step + 1],
                attention_mask=attention_mask,
                position_ids=next_position + step,
                use_cache=True,
                **{self._cache_argument: _cache_of(output)},
            )
        return sampled_messages(tokens, token_mask, token_log_probs, token_entropy, ended)

    def _hit_stop_string(self, tokens: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``(B,)``: rows among ``candidates`` whose last tokens' text contains a stop string."""
        hit = torch.zeros_like(candidates)
        rows = candidates.nonzero().squeeze(-1).tolist()
        if not rows:
            return hit
        for row in rows:
            hit[row] = self.ends_with_stop(tokens[row].tolist())
        return hit

    def ends_with_stop(self, ids: Sequence[int]) -> bool:
        """Whether the text of a message's last tokens holds one of :attr:`stop_strings` (False without any).

        Only the last few tokens are decoded: a stop string spans at most as
        many tokens as it has characters.
        """
        if not self.stop_strings or not ids:
            return False
        tail = self.tokenizer.decode(list(ids)[-self._stop_window :])
        return any(stop in tail for stop in self.stop_strings)

    def log_probs(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log-probabilities and entropies of given messages.

        Parameters
        ----------
        prompt_ids, prompt_mask : torch.Tensor
            ``(B, P)`` prompts, as for :meth:`sample`.
        tokens, token_mask : torch.Tensor
            ``(B, T)`` messages and their masks, as :meth:`sample` returns them.

        Returns
        -------
        token_log_probs : torch.Tensor
            ``(B, T)``: each token's log-probability under the processed
            distribution (the one :meth:`sample` draws from), with gradients;
            0 where ``token_mask`` is False. On the tokens :meth:`sample`
            returned, equal to its ``"token_log_probs"`` up to float error.
        entropy : torch.Tensor
            ``(B, T)``: the entropy of that distribution at each position;
            0 where ``token_mask`` is False.
        """
        scores = self.evaluate(prompt_ids, prompt_mask, tokens, token_mask, with_value=False)
        return scores["token_log_probs"], scores["entropy"]

    def value(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor
    ) -> torch.Tensor:
        """The value head's estimate after each prompt plus message.

        Parameters
        ----------
        prompt_ids, prompt_mask : torch.Tensor
            ``(B, P)`` prompts.
        tokens, token_mask : torch.Tensor
            ``(B, T)`` messages (``T`` may be 0 to value the prompts alone).

        Returns
        -------
        torch.Tensor
            ``(B,)``: the linear head on the last hidden state at the last
            real token of prompt plus message, with gradients (into the
            policy's body too when the body is shared).
        """
        return self.evaluate(prompt_ids, prompt_mask, tokens, token_mask, with_log_probs=False, with_value=True)["value"]

    def evaluate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        with_log_probs: bool = True,
        with_value: Optional[bool] = None,
        value_at: str = "end",
        recompute: Optional[bool] = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probabilities, entropies and value in as few passes as possible.

        With a shared value body, one forward pass of the model gives all
        three; with a separate body, the value takes a second pass.

        Rows go through the model in micro-batches of at most
        :attr:`max_tokens_per_micro_batch` padded tokens. With gradients and
        ``recompute``, each micro-batch's activations are freed after its
        forward pass and recomputed in the backward pass, so the graph of the
        whole update holds the activations of one micro-batch at a time.

        Parameters
        ----------
        prompt_ids, prompt_mask, tokens, token_mask : torch.Tensor
            As for :meth:`log_probs`.
        with_log_probs : bool
            Compute ``"token_log_probs"`` and ``"entropy"``.
        with_value : bool, optional
            Compute ``"value"``; None: if the policy has a value head.
        value_at : str
            ``"end"``: the value after prompt plus message (its last real
            token); ``"prompt"``: the value of the prompt alone (its last real
            token), read from the same pass that scores the message, which
            cannot see the message there (causal attention).
        recompute : bool, optional
            Recompute each micro-batch's activations in the backward pass
            (see above); None: when there are several micro-batches. The
            actor asks for it whenever the passes of all its agents together
            exceed the budget (:meth:`~nip_like.lm.agents.LMActor.score_actions`).

        Returns
        -------
        dict of str to torch.Tensor
            The entries asked for, shaped as :meth:`log_probs` and
            :meth:`value` return them.
        """
        if with_value is None:
            with_value = self.value_head is not None
        if with_value and self.value_head is None:
            raise RuntimeError("this policy has no value head (value_head=False)")
        if value_at not in ("end", "prompt"):
            raise ValueError(f"value_at must be 'end' or 'prompt', got {value_at!r}")
        options = (with_log_probs, with_value, value_at == "prompt")
        self._check_prompts(prompt_ids, prompt_mask)
        prompt_ids, prompt_mask = trim_padding_columns(prompt_ids, prompt_mask)
        lengths = prompt_mask.sum(-1) + token_mask.sum(-1)
        groups = micro_batches(lengths, prompt_ids.shape[1] + tokens.shape[1], self.max_tokens_per_micro_batch)
        stand_ins = self._lockstep_stand_ins(len(groups), lengths.device)
        recompute = len(groups) > 1 if recompute is None else recompute
        if len(groups) == 1 and not stand_ins and not recompute:
            self._scored_tokens[0] += int(lengths.sum())
            self._scored_tokens[1] += lengths.numel() * (prompt_ids.shape[1] + tokens.shape[1])
            return self._evaluate_rows(prompt_ids, prompt_mask, tokens, token_mask, *options)
        # Micro-batches: with recompute, each group's activations are freed after its forward pass and recomputed
        # in the backward pass (activation checkpointing per group), so the graph holds one group's activations
        # at a time, while the loss still sees every row: the gradient equals the one-pass gradient.
        parts = []
        for rows in groups:
            group = trim_padding_columns(prompt_ids[rows], prompt_mask[rows])
            width = int(token_mask[rows].sum(-1).max())
            inputs = (*group, tokens[rows, :width], token_mask[rows, :width])
            self._scored_tokens[0] += int(lengths[rows].sum())
            self._scored_tokens[1] += rows.numel() * (group[0].shape[1] + width)
            parts.append((rows, self._micro_batch_pass(inputs, options, recompute)))
        # Lockstep (FSDP2): as many passes as the rank with most micro-batches; a stand-in pass counts zero.
        for _ in range(stand_ins):
            rows = groups[0][:1]
            inputs = (*trim_padding_columns(prompt_ids[rows], prompt_mask[rows]), tokens[rows], token_mask[rows])
            part = self._micro_batch_pass(inputs, options, recompute)
            parts.append((rows, {name: value * 0 for name, value in part.items()}))
        result = {}
        for name in parts[0][1]:
            shape = (tokens.shape[0], *(() if name == "value" else (tokens.shape[1],)))
            merged = None
            for rows, part in parts:
                value = part[name]
                if value.dim() == 2:
                    value = nn.functional.pad(value, (0, tokens.shape[1] - value.shape[1]))
                if merged is None:
                    merged = value.new_zeros(shape)
                # index_put keeps the gradient path into each group's pass (a stand-in adds its zeros).
                merged = merged.index_put((rows,), value, accumulate=True)
            result[name] = merged
        return result

    def _chunked_scores(self, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T)`` log-probabilities and entropies from the hidden states that predict ``tokens``, chunk by chunk."""
        head = self.model.get_output_embeddings()
        scores = []
        for start in range(0, tokens.shape[1], self.score_chunk_tokens):
            part = slice(start, start + self.score_chunk_tokens)
            if torch.is_grad_enabled():
                # A contiguous copy: a view would keep the whole hidden-state tensor alive for the recomputation.
                scores.append(checkpoint(self._chunk_scores, head, hidden[:, part].contiguous(), tokens[:, part], use_reentrant=False))
            else:
                scores.append(self._chunk_scores(head, hidden[:, part], tokens[:, part]))
        return torch.cat([lp for lp, _ in scores], dim=1), torch.cat([ent for _, ent in scores], dim=1)

    def _chunk_scores(self, head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = processed_log_probs(head(hidden), self.banned, self.settings)
        return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy(log_probs)

    def _check_chunking(self, output) -> None:
        """Refuse ``score_chunk_tokens`` for a model whose logits are not its output layer on its last hidden state."""
        with torch.no_grad():
            head = self.model.get_output_embeddings()
            expected = output.logits[:, -1].float()
            found = head(output.hidden_states[-1][:, -1]).float() if head is not None else None
        if found is None or not torch.allclose(found, expected, rtol=1e-4, atol=1e-4):
            raise ConfigError(
                f"score_chunk_tokens: the logits of {type(self.model).__name__} are not its output layer applied to its "
                "last hidden state (a soft cap or scale between them); set score_chunk_tokens=null"
            )

    def _micro_batch_pass(self, inputs: tuple[torch.Tensor, ...], options: tuple, recompute: bool) -> dict[str, torch.Tensor]:
        """One micro-batch's pass of :meth:`evaluate`; with gradients and ``recompute``, its activations are recomputed in the backward pass."""
        if recompute and torch.is_grad_enabled():
            return checkpoint(self._evaluate_rows, *inputs, *options, use_reentrant=False)
        return self._evaluate_rows(*inputs, *options)

    def _lockstep_stand_ins(self, passes: int, device: torch.device) -> int:
        """Stand-in passes this rank adds so that every rank takes as many scoring passes (0 unless :attr:`lockstep`)."""
        if not self.lockstep:
            return 0
        most = torch.tensor([passes], device=device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return int(most) - passes

    @property
    def defers_lora(self) -> bool:
        """Whether LoRA adapters are still to be added after the warm start (:meth:`after_warm_start`)."""
        return self._deferred_lora is not None

    def after_warm_start(self) -> None:
        """Add the LoRA adapters deferred to after the warm start (``lora.warm_start: full``), once."""
        if self._deferred_lora is not None:
            from nip_like.lm.lora import add_lora

            self.model = add_lora(self.model, self._deferred_lora)
            self._deferred_lora = None
            self.fitted_base = True

    def play_with(self, model: nn.Module, fitted_base: bool = False) -> None:
        """Play with ``model`` from now on (another agent's, whose adapters came after the warm start), adding none of its own."""
        self.model = model
        self._deferred_lora = None
        self.fitted_base = fitted_base

    def pop_padding_counts(self) -> tuple[int, int]:
        """Real and padded-total tokens of the scoring passes since the last call, then reset."""
        counts = tuple(self._scored_tokens)
        self._scored_tokens = [0, 0]
        return counts

    def _evaluate_rows(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        with_log_probs: bool,
        with_value: bool,
        value_of_prompt: bool = False,
    ) -> dict[str, torch.Tensor]:
        """One pass of :meth:`evaluate` over the given rows (``value_of_prompt``: the value at the prompt's last token)."""
        prompt_length, message_length = prompt_ids.shape[1], tokens.shape[1]
        input_ids = torch.cat([prompt_ids, tokens], dim=-1)
        attention_mask = torch.cat([prompt_mask, token_mask], dim=-1).long()
        positions = position_ids(attention_mask)
        shared_hidden = with_value and self.value_head.shared_body
        chunked = with_log_probs and self.score_chunk_tokens is not None
        result: dict[str, torch.Tensor] = {}
        if with_log_probs or shared_hidden:
            extra = {}
            if self._keeps_logits:
                # Only the logits that predict the message: the last message_length + 1 positions (chunked: none kept).
                extra["logits_to_keep"] = message_length + 1 if with_log_probs and not chunked else 1
            output = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                use_cache=False,
                output_hidden_states=shared_hidden or chunked,
                **extra,
            )
        if chunked:
            hidden = output.hidden_states[-1][:, prompt_length - 1 : prompt_length - 1 + message_length]
            token_log_probs, token_entropy = self._chunked_scores(hidden, tokens)
            result["token_log_probs"] = torch.where(token_mask, token_log_probs, 0.0)
            result["entropy"] = torch.where(token_mask, token_entropy, 0.0)
        elif with_log_probs:
            # The logits at position i predict token i + 1: the message's tokens are predicted from P - 1 on.
            first = 0 if self._keeps_logits else prompt_length - 1
            logits = output.logits[:, first : first + message_length]
            log_probs = processed_log_probs(logits, self.banned, self.settings)
            token_log_probs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            result["token_log_probs"] = torch.where(token_mask, token_log_probs, 0.0)
            result["entropy"] = torch.where(token_mask, entropy(log_probs), 0.0)
        if with_value:
            if shared_hidden:
                hidden = output.hidden_states[-1]
            else:
                hidden = self.value_head.body_last_hidden(input_ids, attention_mask, positions)
            counted = prompt_mask.long() if value_of_prompt else attention_mask
            last_real = (counted * torch.arange(counted.shape[1], device=counted.device)).argmax(-1)
            last_hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_real]
            result["value"] = self.value_head(last_hidden.float())
        return result

    forward = evaluate

    def _draw(self, log_probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        """One token per row from ``(B, vocab)`` log-probabilities, ``(B,)`` long."""
        probs = log_probs.exp()
        if generator is not None and generator.device != probs.device:
            probs = probs.to(generator.device)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(log_probs.device)

    @staticmethod
    def _check_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
            raise ValueError(
                f"prompts must be (B, P) with a mask of the same shape, got {tuple(prompt_ids.shape)} "
                f"and {tuple(prompt_mask.shape)}"
            )
        if prompt_mask.dtype != torch.bool:
            raise ValueError(f"the prompt mask must be boolean, got {prompt_mask.dtype}")
        if not bool(prompt_mask.any(-1).all()):
            raise ValueError("every prompt needs at least one real token (start prompts with <bos>)")
