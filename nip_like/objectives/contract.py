"""What the RL loop may ask of a loss: the declared loss contract.

:class:`~nip_like.trainers.rl.TensorDictRlTrainer` trains any TorchRL
``LossModule``. Around the loss's ``forward`` it needs five answers, and this
module is the only place they are defined:

* :meth:`RolloutLoss.layout_rollouts`: how a collected ``(env, time)`` batch
  becomes replay-buffer items (transitions by default; preference pairs,
  episodes, groups for other losses);
* :meth:`RolloutLoss.layout_metrics`: statistics of the last layout, logged
  under ``train/``;
* :attr:`RolloutLoss.needs_groups`: whether the loss compares episodes that
  started alike, so that ``trainer.group_size`` must be at least 2;
* :meth:`RolloutLoss.start_iteration`: a hook called before each iteration's
  layout, for a reference policy that moves;
* :meth:`RolloutLoss.metric_name`: the logged name of each output key, so that
  a new loss term needs no edit anywhere else.

A loss that subclasses :class:`RolloutLoss` answers them itself; any other
``LossModule`` (TorchRL's ``A2CLoss``, a user's own) gets the defaults through
:func:`contract_of` and keeps working unchanged. :func:`use_agent_keys` points
a TorchRL loss at the multi-agent keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from tensordict import TensorDictBase
from torchrl.objectives import LossModule

from nip_like import keys
from nip_like.distributed import concatenated

#: Logged names of the output keys TorchRL's losses and nip_like's share (TRL's names where they exist).
STANDARD_METRIC_NAMES: Mapping[str, str] = {
    "loss_objective": "loss/policy",
    "loss_actor": "loss/policy",
    "loss_critic": "loss/value",
    "loss_value": "loss/value",
    "loss_entropy": "loss/entropy",
    "entropy": "policy/entropy",
    "kl_approx": "policy/approxkl",
    "clip_fraction": "policy/clipfrac",
}


def default_metric_name(key: str) -> str:
    """The logged name of a loss output key that a loss does not name itself.

    A key that already carries a namespace (``rewards/chosen``) is kept; the
    standard keys get :data:`STANDARD_METRIC_NAMES`; any other ``loss_<term>``
    becomes ``loss/<term>`` and any other statistic ``train/<key>``.
    """
    if "/" in key:
        return key
    if key in STANDARD_METRIC_NAMES:
        return STANDARD_METRIC_NAMES[key]
    if key.startswith("loss_"):
        return f"loss/{key[len('loss_'):]}"
    return f"train/{key}"


def transitions(batch: TensorDictBase) -> TensorDictBase:
    """The default layout: the ``(env, time)`` batch flattened into transitions."""
    return batch.reshape(-1)


@dataclass
class ObjectiveConfig:
    """Base of the objective schemas (``trainer.objective``).

    A subclass's fields are exactly the keyword arguments of its loss's
    constructor, so that the trainer builds the loss as
    ``Loss(policy, ..., **options)``. Each option is written once, here: the
    loss names the schema as its :attr:`RolloutLoss.options_schema`, its
    constructor's defaults are the fields' (``beta: float = DPOConfig.beta``),
    and it checks its arguments against the fields' declared ranges
    (:func:`~nip_like.objectives.options.check_options`), so a loss built
    directly is the objective the config names.
    """

    #: The field that names the objective's variant (``"variant"``, ``"loss_type"``), if it has one.
    #: Runs whose variant is not the schema's default are reported as ``<trainer>_<variant>``.
    variant_field: ClassVar[str | None] = None


class LossContract(Protocol):
    """The calls :class:`~nip_like.trainers.rl.TensorDictRlTrainer` makes besides the loss's ``forward``."""

    needs_groups: bool

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase: ...

    def layout_metrics(self) -> dict[str, float]: ...

    def join_layouts(self, parts: list[TensorDictBase]) -> TensorDictBase: ...

    def start_iteration(self, iteration: int) -> None: ...

    def metric_name(self, key: str) -> str: ...


class RolloutLoss(LossModule):
    """Base of the losses the RL loop trains; declares the loss contract with its defaults.

    A subclass overrides what it needs: :meth:`layout_rollouts` (and then
    usually :meth:`layout_metrics`), :attr:`needs_groups`,
    :meth:`start_iteration`, and adds names to :attr:`metric_names` for new
    output keys that the default rule (:func:`default_metric_name`) would not
    name well.
    """

    #: The loss compares episodes that started on the same datapoint (``trainer.group_size >= 2``).
    needs_groups: ClassVar[bool] = False
    #: Logged names of this loss's output keys, beyond :func:`default_metric_name`.
    metric_names: ClassVar[Mapping[str, str]] = {}
    #: The schema whose fields are this loss's keyword options: the constructor's defaults and ranges are its.
    options_schema: ClassVar[type[ObjectiveConfig] | None] = None

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        """Turn a collected ``(env, time)`` batch into buffer items, one per first-dimension entry.

        The default is transitions. Called once per iteration, after the
        advantage module (if any) and under ``torch.no_grad``.
        """
        return transitions(batch)

    def layout_metrics(self) -> dict[str, float]:
        """Statistics of the last :meth:`layout_rollouts` (logged under ``train/``); none by default."""
        return {}

    def join_layouts(self, parts: list[TensorDictBase]) -> TensorDictBase:
        """Under torchrun: the ranks' layouts, in rank order, as one (default: :func:`~nip_like.distributed.concatenated`).

        A layout whose items' shape depends on the batch (episodes padded to
        the longest) pads the parts to one shape here.
        """
        return concatenated(parts)

    def start_iteration(self, iteration: int) -> None:
        """Called before each iteration's layout with the 0-based iteration (a moving reference syncs here)."""

    def metric_name(self, key: str) -> str:
        """The logged name of output key ``key``."""
        return self.metric_names.get(key) or default_metric_name(key)


class PlainLossContract:
    """The contract's defaults, for a ``LossModule`` that does not subclass :class:`RolloutLoss` (they do not depend on the loss)."""

    needs_groups = False

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        """Transitions (:func:`transitions`)."""
        return transitions(batch)

    def layout_metrics(self) -> dict[str, float]:
        """None."""
        return {}

    def join_layouts(self, parts: list[TensorDictBase]) -> TensorDictBase:
        """Concatenated (:func:`~nip_like.distributed.concatenated`)."""
        return concatenated(parts)

    def start_iteration(self, iteration: int) -> None:
        """Nothing to do."""

    def metric_name(self, key: str) -> str:
        """:func:`default_metric_name`."""
        return default_metric_name(key)


def contract_of(loss: LossModule) -> LossContract:
    """The contract the RL loop uses for ``loss``: the loss itself if it declares one, else the defaults."""
    return loss if isinstance(loss, RolloutLoss) else PlainLossContract()


def use_agent_keys(loss: LossModule) -> LossModule:
    """Point a TorchRL loss at the ``("agents", ...)`` keys and the active mask; return it.

    Sets every tensordict key that ``loss`` accepts among advantage, value
    target, value, action, log-probability, reward, done and terminated to its
    ``("agents", ...)`` entry (:mod:`nip_like.keys`), and sets
    ``loss.loss_mask_key`` to ``("agents", "active")`` so that inactive
    agents' steps are left out of the loss terms.

    Parameters
    ----------
    loss : LossModule
        A TorchRL loss such as ``A2CLoss`` or ``ClipPPOLoss``.
    """
    accepted: dict[str, Any] = loss.tensor_keys.__dataclass_fields__ if hasattr(loss, "tensor_keys") else {}
    wanted = {
        "advantage": keys.ADVANTAGE_KEY,
        "value_target": keys.VALUE_TARGET_KEY,
        "value": keys.VALUE_KEY,
        "action": keys.ACTION_KEY,
        "sample_log_prob": keys.LOG_PROB_KEY,
        "reward": keys.REWARD_KEY,
        "done": keys.DONE_KEY,
        "terminated": keys.TERMINATED_KEY,
    }
    loss.set_keys(**{name: key for name, key in wanted.items() if name in accepted})
    loss.loss_mask_key = keys.ACTIVE_KEY
    return loss
