"""Fast decoding: a static KV cache, fixed shapes, and on CUDA a compiled step replayed as CUDA graphs.

:class:`Decoder` is what :meth:`nip_like.lm.policy.LMPolicy.sample` calls. It
picks one of three paths for each call (``LMAgentConfig.decoding``):

``eager``
    :func:`nip_like.lm.decoding.decode`, unchanged: the model's own growing
    KV cache, one forward pass per token, each a few hundred kernel launches.
``static``
    :func:`static_decode`: a KV cache of fixed size (transformers'
    ``StaticCache``, prompt plus ``max_new_tokens`` slots) and a step of fixed
    shapes: the last token ``(B, 1)``, its position ``(B, 1)`` and the
    attention mask over every slot ``(B, capacity)``, the slots not yet
    written masked out. The same messages as ``eager`` (greedily; the same
    distribution when sampling).
``compiled``
    ``static`` with the step (the model's forward and the processing of its
    logits, :func:`~nip_like.lm.sampling.processed_log_probs`) compiled by
    ``torch.compile(mode="reduce-overhead")``: on CUDA, inductor's kernels
    replayed as a CUDA graph, one launch per token instead of hundreds. The
    prompt's pass stays eager, as in transformers' ``generate``.

``auto`` (the default) is ``compiled`` on CUDA and ``eager`` elsewhere (on the
CPU compiling takes about a minute, longer than most decoding there, and a
model of real size is bound by arithmetic rather than by launches). Where the
static path cannot apply (a model class that does not declare static-cache
support, a sliding window shorter than prompt plus message, cache layers that
are not plain static ones, a sharded FSDP model) the decoder falls back to
``eager``; where compilation fails, to ``static``. Each choice is logged once
per process (logger ``nip_like.lm.static_decoding``), by the first agent that
makes it: at INFO when it is what was asked for, as a WARNING when it is a
fallback, with the reason.

``sampling_dtype="bfloat16"`` samples with a bfloat16 copy of the model's
parameters (:func:`sampling_model`; buffers such as rotary frequencies stay as
they are), refreshed whenever a parameter has changed since the last call
(an optimiser step, a loaded snapshot), so a token reads half the bytes. The
scoring passes (:meth:`~nip_like.lm.policy.LMPolicy.evaluate`) still use the
model itself: the stored log-probabilities are then the bfloat16 model's, and
the first PPO ratio is 1 only within bfloat16 error (as under
``run.autocast_dtype``).

Transformers versions: the cache is ``StaticCache(config=..., max_cache_len=...)``
(4.56 to 5.x; older releases also wanted the batch size, device and dtype, and
get them). In 5.17 and 5.24 each static layer counts its own written slots
(``cumulative_length``, reset between calls); in 4.56 the forward pass takes a
``cache_position`` instead, which is passed wherever the model's ``forward``
names it. The cache is passed under the name the forward takes
(:func:`~nip_like.lm.decoding.cache_argument`: ``cache`` from 5.24,
``past_key_values`` before).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from nip_like.interrupts import stop_point
from nip_like.lm.decoding import (
    DECODING_PHASE, decode, draw_tokens, forward_parameters, message_buffers, rows_ending_with_stop, sampled_messages,
)
from nip_like.lm.padding import check_prompts, position_ids, trim_left_padding
from nip_like.lm.sampling import SamplingSettings, entropy, processed_log_probs
from nip_like.lm.sampling_copy import SAMPLING_DTYPES, sampling_model

log = logging.getLogger(__name__)

#: The values of ``LMAgentConfig.decoding``.
DECODING_MODES = ("auto", "eager", "static", "compiled")
#: The compiled path rounds a cache's slots up to a multiple of this, so that prompts of close lengths share a graph.
CAPACITY_MULTIPLE = 64
#: The static paths read "has every row ended?" (a wait for the device) once every this many tokens, not every token.
CHECK_EVERY = 8
#: Shapes (rows, slots, dtype) one decoder compiles at most; a call of a further shape takes the static step uncompiled.
MAX_COMPILED_SHAPES = 8
#: Caches one decoder keeps between calls on the compiled path (one per batch size, the most recent ones).
HELD_CACHES = 2
#: ``torch._dynamo``'s recompile limit while a compiled step runs (every decoder's shapes share one code object).
RECOMPILE_LIMIT = 64


#: The lines logged so far: each choice or fallback is logged once per process, whichever agent meets it first.
_LOGGED: set[str] = set()


class Unsupported(Exception):
    """The static path cannot run this model; the message says why (it is logged)."""


# ------------------------------------------------------------------ the step
def decode_step(model: nn.Module, inputs: dict[str, Any], banned: torch.Tensor, settings: SamplingSettings):
    """One token's forward pass and its processed distribution: ``(log_probs (B, vocab), entropy (B,))``.

    The function that is compiled: every tensor it gets has the same shape at
    every token of a call.
    """
    output = model(**inputs)
    log_probs = processed_log_probs(output.logits[:, -1], banned, settings)
    return log_probs, entropy(log_probs)


_COMPILED_STEP: Optional[Callable] = None


def compiled_step() -> Callable:
    """:func:`decode_step` through ``torch.compile(mode="reduce-overhead", dynamic=False)``, built once per process."""
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        _COMPILED_STEP = torch.compile(decode_step, mode="reduce-overhead", dynamic=False)
    return _COMPILED_STEP


@contextmanager
def recompile_limit(limit: int) -> Iterator[None]:
    """Raise ``torch._dynamo``'s recompile limit (``recompile_limit``, formerly ``cache_size_limit``) inside the block."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name, limit) >= limit:
        yield
        return
    with config.patch(**{name: limit}):
        yield


# ------------------------------------------------------------------ the static cache
def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are distributed tensors (an FSDP2 model)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def static_problem(model: nn.Module) -> Optional[str]:
    """Why the static path cannot run ``model`` (None: it can, as far as can be told before a cache is built)."""
    base = base_model(model)
    if not getattr(type(base), "_can_compile_fullgraph", False):
        return f"{type(base).__name__} does not declare static-cache support (_can_compile_fullgraph)"
    if is_sharded(model):
        return "its parameters are sharded (FSDP)"
    try:
        from transformers import StaticCache  # noqa: F401
        from transformers.cache_utils import StaticLayer  # noqa: F401
    except ImportError:
        return "this transformers release has no StaticCache with StaticLayer layers"
    return None


def new_static_cache(model: nn.Module, batch_size: int, capacity: int, dtype: torch.dtype, device: torch.device):
    """A transformers ``StaticCache`` of ``capacity`` slots for ``model``, every layer a plain ``StaticLayer``.

    Sliding-window layers whose window holds every slot are replaced by plain
    static layers (they attend to the same slots; a sliding layer keeps a
    Python counter that a compiled step would guard on).

    Raises
    ------
    Unsupported
        The cache cannot be built, or it has layers that are not static ones
        (linear attention, indexed or chunked layers), or a sliding window
        shorter than ``capacity``.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    config = base_model(model).config
    try:
        cache = StaticCache(config=config, max_cache_len=capacity)
    except TypeError:  # before 4.56: the batch size, device and dtype were arguments
        try:
            cache = StaticCache(config=config, max_batch_size=batch_size, max_cache_len=capacity, device=device,
                                dtype=dtype)
        except Exception as error:  # noqa: BLE001 - any failure means no static cache here
            raise Unsupported(f"StaticCache cannot be built: {first_line(error)}") from error
    except Exception as error:  # noqa: BLE001
        raise Unsupported(f"StaticCache cannot be built: {first_line(error)}") from error
    layers = getattr(cache, "layers", None)
    if not layers:
        raise Unsupported(f"{type(cache).__name__} has no per-layer caches in this transformers release")
    window = getattr(config.get_text_config(), "sliding_window", None)
    for index, layer in enumerate(layers):
        if getattr(layer, "is_sliding", False):
            if window is None or window < capacity:
                raise Unsupported(f"a sliding window of {window} tokens, shorter than prompt plus message ({capacity})")
            layers[index] = StaticLayer(max_cache_len=capacity)
        elif type(layer) is not StaticLayer:
            raise Unsupported(f"its cache has {type(layer).__name__} layers, not plain static ones")
    return cache


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


# ------------------------------------------------------------------ the loop
def static_decode(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    generator: Optional[torch.Generator],
    greedy: bool,
    *,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_id: int,
    banned: torch.Tensor,
    settings: SamplingSettings,
    keeps_logits: bool,
    cache_argument: str,
    ends_with_stop: Optional[Callable[[Sequence[int]], bool]] = None,
    stops: bool = True,
    cache: Any,
    capacity: int,
    step: Callable = decode_step,
    check_every: int = CHECK_EVERY,
) -> tuple[dict[str, torch.Tensor], int]:
    """Sample one message per prompt with a static KV cache (the model in eval mode, gradients off).

    The arguments up to ``stops`` and the messages returned are those of
    :func:`nip_like.lm.decoding.decode`; so are the left padding, positions,
    bans, sampling settings, stop strings, ``<eos>`` and the stop requests
    (:func:`~nip_like.interrupts.stop_point` before each token).

    Parameters
    ----------
    cache : transformers.StaticCache
        A cache of ``capacity`` slots (:func:`new_static_cache`), empty or of
        an earlier call (it is reset first).
    capacity : int
        Its slots: at least the trimmed prompt's width plus ``max_new_tokens``.
    step : callable
        :func:`decode_step` or its compiled form; every token after the first
        is one call of it, with tensors of the same shapes.
    check_every : int
        Read whether every row has ended once every this many tokens (each
        read waits for the device); a row that has ended stays ended, so the
        messages do not depend on it. With stop strings, at every token.

    Returns
    -------
    messages : dict of str to torch.Tensor
        As :func:`~nip_like.lm.decoding.decode` returns them.
    passes : int
        Forward passes made: the prompt's, then one per further token.
    """
    check_prompts(prompt_ids, prompt_mask)
    prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask)
    (batch_size, width), device = prompt_ids.shape, prompt_ids.device
    length = max_new_tokens
    if capacity < width + length:
        raise ValueError(f"a cache of {capacity} slots cannot hold {width} prompt and {length} message tokens")
    tokens, token_mask, token_log_probs, token_entropy, alive, ended = message_buffers(batch_size, length, pad_token_id, device)

    # The mask over every slot: the prompt's, then one slot per token as it is fed back; unwritten slots stay 0.
    attention_mask = torch.zeros((batch_size, capacity), dtype=torch.long, device=device)
    attention_mask[:, :width] = prompt_mask
    positions = prompt_mask.sum(-1, keepdim=True) + torch.arange(length, device=device)
    takes_cache_position = "cache_position" in forward_parameters(model)
    slots = torch.arange(capacity, device=device)
    cache.reset()
    prompt_inputs = {
        "input_ids": prompt_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids(prompt_mask),
        "use_cache": True,
        cache_argument: cache,
    }
    if takes_cache_position:
        prompt_inputs["cache_position"] = slots[:width]
    if keeps_logits:
        prompt_inputs["logits_to_keep"] = 1
    log_probs = processed_log_probs(model(**prompt_inputs).logits[:, -1], banned, settings)
    distribution_entropy = entropy(log_probs)
    on_cuda = device.type == "cuda" and step is not decode_step
    passes = 1
    for index in range(length):
        if stops:
            stop_point(DECODING_PHASE)  # a look at a list until a signal comes (see nip_like.interrupts)
        token = log_probs.argmax(-1) if greedy else draw_tokens(log_probs, generator)
        tokens[:, index] = token
        token_mask[:, index] = alive
        token_log_probs[:, index] = log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        token_entropy[:, index] = distribution_entropy
        stopped = alive & (token == eos_token_id)
        if ends_with_stop is not None:
            stopped = stopped | rows_ending_with_stop(tokens[:, : index + 1], alive & ~stopped, ends_with_stop)
        ended = ended | stopped
        alive = alive & ~stopped
        if index == length - 1:
            break
        if (ends_with_stop is not None or (index + 1) % check_every == 0) and not bool(alive.any()):
            break
        attention_mask[:, width + index] = token_mask[:, index]
        inputs = {
            "input_ids": token.unsqueeze(-1),
            "attention_mask": attention_mask,
            "position_ids": positions[:, index : index + 1],
            "use_cache": True,
            cache_argument: cache,
        }
        if takes_cache_position:
            inputs["cache_position"] = slots[width + index : width + index + 1]
        if on_cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs have been read: their memory may go
        log_probs, distribution_entropy = step(model, inputs, banned, settings)
        passes += 1
    # Rows that ended keep <pad>, log-probability 0 and entropy 0 after their last token, as decode writes them.
    tokens.masked_fill_(~token_mask, pad_token_id)
    token_log_probs.masked_fill_(~token_mask, 0.0)
    token_entropy.masked_fill_(~token_mask, 0.0)
    return sampled_messages(tokens, token_mask, token_log_probs, token_entropy, ended), passes


# ------------------------------------------------------------------ the decoder
@dataclass
class _HeldCache:
    """A static cache kept between calls of the compiled path (its tensors' addresses are in the CUDA graphs)."""

    model: "weakref.ref[nn.Module]"
    capacity: int
    dtype: torch.dtype
    device: torch.device
    cache: Any


class Decoder:
    """How one policy decodes: the path of each call, its held caches, the one-time log lines.

    Parameters
    ----------
    mode : str
        ``auto``, ``eager``, ``static`` or ``compiled`` (see the module).
    sampling_dtype : str
        ``model`` or ``bfloat16`` (see :func:`sampling_model`).

    Attributes
    ----------
    last_path : str or None
        The path of the last call: ``eager``, ``static`` or ``compiled``.
    last_passes : int
        Forward passes of the last call (prompt included).
    last_capacity : int
        Slots of the static cache of the last call (0 on the eager path).
    compiled_shapes : set
        ``(rows, slots, dtype)`` shapes compiled so far.
    """

    def __init__(self, mode: str = "auto", sampling_dtype: str = "model") -> None:
        if mode not in DECODING_MODES:
            raise ValueError(f"decoding must be one of {DECODING_MODES}, got {mode!r}")
        if sampling_dtype not in SAMPLING_DTYPES:
            raise ValueError(f"sampling_dtype must be one of {SAMPLING_DTYPES}, got {sampling_dtype!r}")
        self.mode = mode
        self.sampling_dtype = sampling_dtype
        self.last_path: Optional[str] = None
        self.last_passes = 0
        self.last_capacity = 0
        self.compiled_shapes: set[tuple] = set()
        self.compile_error: Optional[str] = None
        self._unsupported: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self._held: "OrderedDict[int, _HeldCache]" = OrderedDict()

    # A policy copied (a reference policy, a snapshot) gets a decoder of its own, with nothing held.
    def __deepcopy__(self, memo: dict) -> "Decoder":
        return Decoder(self.mode, self.sampling_dtype)

    def __getstate__(self) -> dict:
        return {"mode": self.mode, "sampling_dtype": self.sampling_dtype}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["mode"], state["sampling_dtype"])

    def __repr__(self) -> str:
        return f"Decoder(mode={self.mode!r}, sampling_dtype={self.sampling_dtype!r})"

    def release(self) -> None:
        """Drop the caches held between calls (their memory goes back to the allocator)."""
        self._held.clear()

    def _note(self, message: str, fallback: bool) -> None:
        """Log ``message`` once per process: a WARNING for a fallback, else INFO."""
        if message not in _LOGGED:
            _LOGGED.add(message)
            log.log(logging.WARNING if fallback else logging.INFO, message)

    def choose(self, model: nn.Module, device: torch.device) -> str:
        """The path of a call on ``device`` (logged once, with why): ``eager``, ``static`` or ``compiled``."""
        mode = self.mode
        if mode == "eager":
            self._note("decoding: eager (decoding=eager)", fallback=False)
            return "eager"
        if mode == "auto" and device.type != "cuda":
            self._note(f"decoding: eager on {device.type} (decoding=auto compiles the step with a static KV cache on "
                       f"CUDA only)", fallback=False)
            return "eager"
        problem = self._unsupported.get(model)
        if problem is None and model not in self._unsupported:
            problem = static_problem(model)
            self._unsupported[model] = problem
        if problem is not None:
            self._note(f"decoding: eager instead of {'compiled' if mode == 'auto' else mode} (decoding={mode}): "
                       f"{problem}", fallback=True)
            return "eager"
        if mode == "static":
            self._note("decoding: static KV cache, step uncompiled (decoding=static)", fallback=False)
            return "static"
        if self.compile_error is not None:
            self._note(f"decoding: static KV cache, step uncompiled, instead of compiled (decoding={mode}): "
                       f"torch.compile failed: {self.compile_error}", fallback=True)
            return "static"
        cudagraphs = "as CUDA graphs" if device.type == "cuda" else "without CUDA graphs on the CPU"
        self._note(f"decoding: static KV cache, step compiled (torch.compile mode=reduce-overhead, {cudagraphs}; "
                   f"decoding={mode})", fallback=False)
        return "compiled"

    def _cache(self, model: nn.Module, batch_size: int, needed: int, dtype: torch.dtype, device: torch.device,
               keep: bool) -> tuple[Any, int]:
        """A cache of at least ``needed`` slots: a held one if it fits, else a new one (held if ``keep``).

        Held caches (the compiled path) are rounded up to :data:`CAPACITY_MULTIPLE`
        slots, and a cache that grows at least doubles, so that a run compiles
        few shapes; at most :data:`HELD_CACHES` batch sizes are held.
        """
        held = self._held.get(batch_size)
        if held is not None and held.model() is model and held.dtype == dtype and held.device == device:
            if held.capacity >= needed:
                self._held.move_to_end(batch_size)
                return held.cache, held.capacity
            capacity = max(round_up(needed, CAPACITY_MULTIPLE), 2 * held.capacity)
        else:
            capacity = round_up(needed, CAPACITY_MULTIPLE) if keep else needed
        self._held.pop(batch_size, None)  # its memory goes before the new cache's comes
        cache = new_static_cache(model, batch_size, capacity, dtype, device)
        if keep:
            self._held[batch_size] = _HeldCache(weakref.ref(model), capacity, dtype, device, cache)
            while len(self._held) > HELD_CACHES:
                self._held.popitem(last=False)
        return cache, capacity

    def decode(self, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               generator: Optional[torch.Generator], greedy: bool, **options: Any) -> dict[str, torch.Tensor]:
        """Sample one message per prompt on the chosen path (arguments and result of :func:`~nip_like.lm.decoding.decode`).

        ``model`` is the policy's model, in eval mode; with
        ``sampling_dtype="bfloat16"`` its bfloat16 copy samples.
        """
        sharded = is_sharded(model)
        options = {**options, "stops": not sharded}  # the ranks of a sharded model take every pass together
        if self.sampling_dtype != "model" and sharded:
            self._note(f"sampling_dtype={self.sampling_dtype} ignored: the model's parameters are sharded (FSDP)",
                       fallback=True)
        else:
            model = sampling_model(model, self.sampling_dtype)
        path = self.choose(model, prompt_ids.device)
        if path != "eager":
            try:
                return self._static(model, path, prompt_ids, prompt_mask, generator, greedy, options)
            except Unsupported as problem:
                self._unsupported[model] = str(problem)
                path = self.choose(model, prompt_ids.device)
        self.last_path, self.last_capacity = "eager", 0
        messages = decode(model, prompt_ids, prompt_mask, generator, greedy, **options)
        self.last_passes = max(int(messages["num_tokens"].max()), 1)
        return messages

    def _static(self, model: nn.Module, path: str, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                generator: Optional[torch.Generator], greedy: bool, options: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One call of the static or compiled path (:func:`static_decode`)."""
        real = prompt_mask.any(0)
        width = prompt_ids.shape[1] - (int(real.long().argmax()) if bool(real.any()) else 0)
        needed = width + options["max_new_tokens"]
        batch_size, device = prompt_ids.shape[0], prompt_ids.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else next(
            model.parameters()).dtype
        cache, capacity = self._cache(model, batch_size, needed, dtype, device, keep=path == "compiled")
        step: Callable = decode_step
        if path == "compiled":
            shape = (batch_size, capacity, dtype)
            if shape not in self.compiled_shapes and len(self.compiled_shapes) >= MAX_COMPILED_SHAPES:
                self._note(f"decoding: static KV cache, step uncompiled for new shapes: {MAX_COMPILED_SHAPES} shapes "
                           f"(rows, slots) compiled already", fallback=True)
                path = "static"
            else:
                self.compiled_shapes.add(shape)
                step = self._guarded(compiled_step(), shape)
        context = recompile_limit(RECOMPILE_LIMIT) if path == "compiled" else nullcontext()
        with context:
            messages, passes = static_decode(model, prompt_ids, prompt_mask, generator, greedy, cache=cache,
                                             capacity=capacity, step=step, **options)
        self.last_path = path if self.compile_error is None else "static"
        self.last_passes, self.last_capacity = passes, capacity
        return messages

    def _guarded(self, compiled: Callable, shape: tuple) -> Callable:
        """``compiled``, falling back to :func:`decode_step` for good (logged) if compiling or running it fails."""

        def step(*args: Any) -> Any:
            if self.compile_error is None:
                try:
                    return compiled(*args)
                except Exception as error:  # noqa: BLE001 - any failure of torch.compile: decode uncompiled
                    self.compile_error = first_line(error)
                    self.compiled_shapes.discard(shape)
                    self.choose(args[0], args[1]["input_ids"].device)  # logs the fallback once
            return decode_step(*args)

        return step
