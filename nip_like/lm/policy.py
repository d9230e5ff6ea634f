"""A causal language model as a policy: sample messages, score them, value them.

:class:`LMPolicy` wraps a Hugging Face causal LM and its tokenizer. It samples
a message token by token with the KV cache (:meth:`LMPolicy.sample`, the loop
in :mod:`nip_like.lm.decoding`), and recomputes the same log-probabilities
with gradients in one teacher-forced pass (:meth:`LMPolicy.log_probs`, the
pass in :mod:`nip_like.lm.teacher_forcing`, in micro-batches within a token budget by
:mod:`nip_like.lm.micro_batches`), so that the PPO ratio is exactly 1 on the
first epoch. Everything is dense and padded (:mod:`nip_like.lm.padding`):

* prompts ``(B, P)`` with a boolean mask, padded on the left (any layout of
  the mask works: positions are counted over the real tokens only);
* messages ``(B, T)`` with ``T = max_new_tokens``: the sampled tokens, ``<eos>``
  included, then ``<pad>`` with mask False.

Position ids are ``mask.cumsum(-1) - 1`` clamped at 0 everywhere, so a
left-padded row gets the same logits as the same row unpadded.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
from torch import nn

from nip_like.errors import ConfigError
from nip_like.lm.decoding import cache_argument, forward_parameters, sampled_messages
from nip_like.lm.micro_batches import micro_batches, scores_by_micro_batch
from nip_like.lm.padding import check_prompts, position_ids, trim_left_padding, trim_padding_columns
from nip_like.lm.sampling import SamplingSettings
from nip_like.lm.teacher_forcing import check_chunking, score_rows, scores_in_chunks
from nip_like.lm.sampling_copy import SAMPLING_DTYPES
from nip_like.lm.static_decoding import DECODING_MODES, Decoder
from nip_like.lm.value import LMValueHead

if TYPE_CHECKING:  # transformers loads on first use: runs without language models never import it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: The policy, the helpers defined here, and the names that moved to the modules above (still importable from here).
__all__ = [
    "LMPolicy",
    "cache_argument",
    "in_mode",
    "micro_batches",
    "model_device",
    "position_ids",
    "sampled_messages",
    "trim_left_padding",
    "trim_padding_columns",
]


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
        output embeddings applied to their last hidden state (checked once by
        a forward pass of two tokens: for a number when the policy is built,
        which refuses another model; for the default at the first scoring
        pass with gradients, see :attr:`chunkable`). None (the default): automatic, i.e.
        in passes with gradients, chunks of at most 256 MiB of logits
        (:func:`~nip_like.lm.teacher_forcing.auto_chunk_positions`) for a model that
        allows it and is not sharded (:attr:`sharded`), all logits at once
        otherwise (logged once); 0: all logits at once.
    deferred_lora : LoraOptions, optional
        LoRA adapters to add after the warm start (:meth:`after_warm_start`)
        instead of now.
    decoding : str
        How :meth:`sample` decodes: ``auto`` (compiled on CUDA, eager
        elsewhere), ``eager``, ``static`` or ``compiled`` (see
        :mod:`nip_like.lm.static_decoding`).
    sampling_dtype : str
        ``model``: sample with the model's own parameters; ``bfloat16``: with
        a bfloat16 copy of them (scoring unchanged).

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
        decoding: str = "auto",
        sampling_dtype: str = "model",
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
        #: Tokens of activations that an update's graph may hold at once before its micro-batches are recomputed in
        #: the backward pass (:meth:`~nip_like.lm.actor_critic.LMActor.score_actions`); None: the micro-batch budget. The
        #: trainer sets it from the memory free when it sets the automatic budget (not capped as that budget is).
        self.max_tokens_held: Optional[int] = None
        if score_chunk_tokens is not None and score_chunk_tokens < 0:
            raise ConfigError(f"score_chunk_tokens must be at least 0 (0: all logits at once; null: automatic), got {score_chunk_tokens}")
        self.score_chunk_tokens = score_chunk_tokens
        if decoding not in DECODING_MODES:
            raise ConfigError(f"decoding must be one of {', '.join(DECODING_MODES)}, got {decoding!r}")
        if sampling_dtype not in SAMPLING_DTYPES:
            raise ConfigError(f"sampling_dtype must be one of {', '.join(SAMPLING_DTYPES)}, got {sampling_dtype!r}")
        #: How :meth:`sample` decodes (:class:`~nip_like.lm.static_decoding.Decoder`: its path, caches and log lines).
        self.decoder = Decoder(decoding, sampling_dtype)
        self._cache_argument = cache_argument(model)
        self._deferred_lora = deferred_lora
        self._keeps_logits = "logits_to_keep" in forward_parameters(model)
        #: Real and padded tokens of the scoring passes since :meth:`pop_padding_counts` was last called.
        self._scored_tokens = [0, 0]
        #: Whether every rank must run this policy's model the same number of times (its FSDP2 update,
        #: :mod:`nip_like.lm.sharding`): :meth:`evaluate` then takes as many micro-batches as the rank with most.
        self.lockstep = False
        #: Whether the model's weights are sharded across ranks (FSDP2, :mod:`nip_like.lm.sharding`): its output
        #: layer then cannot run apart from its forward pass, so automatic chunked scoring is off.
        self.sharded = False
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
        # Whether the logits are the output layer on the last hidden state (None: not probed yet; see chunkable).
        self._chunkable: Optional[bool] = None
        if score_chunk_tokens:  # a model that cannot be scored in chunks is refused now, before any work
            check_chunking(model, self._probe_output())
            self._chunkable = True

    @torch.no_grad()
    def sample(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        greedy: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Sample one message per prompt, with the KV cache (on the path :attr:`decoder` picks).

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
            return self.decoder.decode(
                self.model,
                prompt_ids,
                prompt_mask,
                generator,
                greedy,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                banned=self.banned,
                settings=self.settings,
                keeps_logits=self._keeps_logits,
                cache_argument=self._cache_argument,
                ends_with_stop=self.ends_with_stop if self.stop_strings else None,
            )

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

    def _probe_output(self):
        """The model's output on two tokens, with its hidden states: what :func:`~nip_like.lm.teacher_forcing.check_chunking` compares."""
        tokens = torch.zeros((1, 2), dtype=torch.long, device=self.banned.device)
        with torch.no_grad():
            return self.model(input_ids=tokens, use_cache=False, output_hidden_states=True)

    @property
    def chunkable(self) -> bool:
        """Whether the model's logits are its output layer on its last hidden state, so that a message can be scored in chunks.

        Probed once, by a forward pass of two tokens, when first asked (the
        first scoring pass with gradients under the automatic setting); a model
        that fails is scored with all its logits at once, which is logged once.
        """
        if self._chunkable is None:
            self._chunkable = scores_in_chunks(self.model, self._probe_output())
            if not self._chunkable:
                log.info(
                    "%s: the logits are not the output layer on the last hidden state; automatic chunked scoring is off "
                    "(each scoring pass holds the message's logits whole)", type(self.model).__name__
                )
        return self._chunkable

    def scoring_chunks(self) -> Optional[int | str]:
        """How :meth:`evaluate`'s passes score a message: chunks of this many positions, ``"auto"`` or None (all at once).

        ``score_chunk_tokens`` as given, with the automatic default resolved
        for this model: ``"auto"`` (chunks sized per pass: every pass with
        gradients, and a pass without them whose logits would exceed one
        chunk's bytes) when its logits can be scored in chunks and its
        weights are not sharded, None otherwise.
        """
        if self.score_chunk_tokens is None:
            # "auto" chunks every pass with gradients, and a pass without them whose logits would exceed one chunk
            # (a large vocabulary: 262,144 tokens make 1 MiB of float32 logits per position; see score_rows).
            return "auto" if not self.sharded and self.chunkable else None
        return self.score_chunk_tokens or None

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
            exceed the budget (:meth:`~nip_like.lm.actor_critic.LMActor.score_actions`).

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
        check_prompts(prompt_ids, prompt_mask)
        prompt_ids, prompt_mask = trim_padding_columns(prompt_ids, prompt_mask)
        # One pass over some rows with this policy's model and distribution: score_rows(prompt_ids, ..., *options).
        one_pass = partial(
            score_rows,
            self.model,
            value_head=self.value_head,
            banned=self.banned,
            settings=self.settings,
            keeps_logits=self._keeps_logits,
            score_chunk_tokens=self.scoring_chunks(),
        )
        return scores_by_micro_batch(
            one_pass,
            prompt_ids,
            prompt_mask,
            tokens,
            token_mask,
            options,
            budget=self.max_tokens_per_micro_batch,
            lockstep=self.lockstep,
            recompute=recompute,
            counts=self._scored_tokens,
        )

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

    forward = evaluate
