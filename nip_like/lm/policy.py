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

from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

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
    ) -> None:
        super().__init__()
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer needs a pad token and an eos token")
        if tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ConfigError("the tokenizer's pad and eos tokens must differ: padding is never sampled, eos is")
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
        banned = torch.zeros(vocab_size, dtype=torch.bool)
        for token_id in (self.pad_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id):
            if token_id is not None and token_id != self.eos_token_id:
                banned[token_id] = True
        banned[len(tokenizer) :] = True
        # (vocab,) booleans: the tokens that are never sampled.
        self.register_buffer("banned", banned, persistent=False)

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
              (False: cut at ``max_new_tokens``).
        """
        self._check_prompts(prompt_ids, prompt_mask)
        batch_size, device = prompt_ids.shape[0], prompt_ids.device
        length = self.max_new_tokens
        tokens = torch.full((batch_size, length), self.pad_token_id, dtype=torch.long, device=device)
        token_mask = torch.zeros((batch_size, length), dtype=torch.bool, device=device)
        token_log_probs = torch.zeros((batch_size, length), dtype=torch.float32, device=device)
        token_entropy = torch.zeros((batch_size, length), dtype=torch.float32, device=device)
        alive = torch.ones(batch_size, dtype=torch.bool, device=device)

        attention_mask = prompt_mask.long()
        next_position = attention_mask.sum(-1, keepdim=True)
        output = self.model(
            input_ids=prompt_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask), use_cache=True
        )
        for step in range(length):
            log_probs = processed_log_probs(output.logits[:, -1], self.banned, self.settings)
            token = log_probs.argmax(-1) if greedy else self._draw(log_probs, generator)
            token_log_prob = log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            tokens[:, step] = torch.where(alive, token, self.pad_token_id)
            token_mask[:, step] = alive
            token_log_probs[:, step] = torch.where(alive, token_log_prob, 0.0)
            token_entropy[:, step] = torch.where(alive, entropy(log_probs), 0.0)
            alive = alive & (token != self.eos_token_id)
            if step == length - 1 or not bool(alive.any()):
                break
            attention_mask = torch.cat([attention_mask, token_mask[:, step : step + 1].long()], dim=-1)
            output = self.model(
                input_ids=tokens[:, step : step + 1],
                attention_mask=attention_mask,
                position_ids=next_position + step,
                past_key_values=output.past_key_values,
                use_cache=True,
            )
        num_tokens = token_mask.sum(-1)
        return {
            "tokens": tokens,
            "token_mask": token_mask,
            "token_log_probs": token_log_probs,
            "token_entropy": token_entropy,
            "log_prob": token_log_probs.sum(-1),
            "num_tokens": num_tokens,
            "finished": (tokens == self.eos_token_id).any(-1),
        }

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
    ) -> dict[str, torch.Tensor]:
        """Log-probabilities, entropies and value in as few passes as possible.

        With a shared value body, one forward pass of the model gives all
        three; with a separate body, the value takes a second pass.

        Parameters
        ----------
        prompt_ids, prompt_mask, tokens, token_mask : torch.Tensor
            As for :meth:`log_probs`.
        with_log_probs : bool
            Compute ``"token_log_probs"`` and ``"entropy"``.
        with_value : bool, optional
            Compute ``"value"``; None: if the policy has a value head.

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
        self._check_prompts(prompt_ids, prompt_mask)
        prompt_length = prompt_ids.shape[1]
        input_ids = torch.cat([prompt_ids, tokens], dim=-1)
        attention_mask = torch.cat([prompt_mask, token_mask], dim=-1).long()
        positions = position_ids(attention_mask)
        shared_hidden = with_value and self.value_head.shared_body
        result: dict[str, torch.Tensor] = {}
        if with_log_probs or shared_hidden:
            output = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                use_cache=False,
                output_hidden_states=shared_hidden,
            )
        if with_log_probs:
            # The logits at position i predict token i + 1: the message's tokens are predicted from P - 1 on.
            logits = output.logits[:, prompt_length - 1 : prompt_length - 1 + tokens.shape[1]]
            log_probs = processed_log_probs(logits, self.banned, self.settings)
            token_log_probs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            result["token_log_probs"] = torch.where(token_mask, token_log_probs, 0.0)
            result["entropy"] = torch.where(token_mask, entropy(log_probs), 0.0)
        if with_value:
            if shared_hidden:
                hidden = output.hidden_states[-1]
            else:
                hidden = self.value_head.body_last_hidden(input_ids, attention_mask, positions)
            last_real = (attention_mask * torch.arange(attention_mask.shape[1], device=attention_mask.device)).argmax(-1)
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
