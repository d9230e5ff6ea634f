"""Small convolutional agents for the image-classification scenario.

Every agent has the same kind of network; what differs is its input (the
environment hides from the verifier the pixels that no message revealed to
it) and its size (``scenario.agents.<name>``).

1. **Input.** Per pixel: the pixels the agent sees (0 where hidden), a flag
   saying whether it sees the pixel, and the message history it read, each
   message a patch, spread over the patch's pixels (one channel per step and
   sender, as the environment lays it out).
2. **Body.** ``conv_layers`` 3x3 convolutions of ``channels`` channels with
   ReLU at the image's resolution, then an average over each patch: one
   vector per patch (the patch tokens), and the mean and the maximum over
   the patches with the one-hot step number (the summary).
3. **Heads.** A patch head on each patch token and the summary; a decision
   head (continue, reject, accept) and a value head on the summary.

The policy is two-stage, as the graph-isomorphism agents' are: the joint
log-probability of sending patch ``p`` is ``log p(continue) + log p(p)``, that
of rejecting or accepting is the decision head's; a
:class:`~nip_like.distributions.GroupedMaskedCategorical` over the patches
makes the greedy action choose between sending, rejecting and accepting
first. Pure torch; any leading batch shape; nothing is created on a fixed
device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nip_like.agent_modules import AgentModules, PerAgent, actor_critic_from_networks
from nip_like.allowed import checked
from nip_like.distributions import GroupedMaskedCategorical
from nip_like.keys import OBSERVATION_KEY
from nip_like.scenarios.image_classification.environment import grid_shape, patches_to_pixels

IN_KEYS = [("agents", "image"), ("agents", "visible"), ("agents", "messages"), OBSERVATION_KEY]
#: Where the agent dimension of each of :data:`IN_KEYS` is.
AGENT_DIMS = (-4, -3, -4, -2)


@dataclass
class ImageAgentConfig:
    """Size of one image-classification agent's networks (:func:`build_image_agents`)."""

    channels: int = checked(16, ge=1)  # channels of each convolution
    conv_layers: int = checked(2, ge=1)  # 3x3 convolutions at the image's resolution
    head_size: int = checked(32, ge=1)  # hidden width of the patch, decision and value heads
    shared_body: bool = False  # the policy and value heads share one body


class ImageBody(nn.Module):
    """Patch tokens and a summary of what an agent sees (see the module docstring).

    Parameters
    ----------
    image_shape : tuple of int
        ``(C, H, W)``.
    patch_size : int
        Side of a patch, in pixels.
    message_channels : int
        Channels of the message history (steps x transcript agents).
    context_features : int
        Size of the one-hot step number.
    channels, conv_layers : int
        Width and depth of the convolutions.
    """

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        patch_size: int,
        message_channels: int,
        context_features: int,
        channels: int,
        conv_layers: int,
    ) -> None:
        super().__init__()
        self.image_shape = tuple(image_shape)
        self.patch_size = patch_size
        self.grid = grid_shape(image_shape[1], image_shape[2], patch_size)
        inputs = image_shape[0] + 1 + message_channels
        self.convolutions = nn.ModuleList(
            nn.Conv2d(inputs if layer == 0 else channels, channels, kernel_size=3, padding=1) for layer in range(conv_layers)
        )
        self.channels = channels
        self.summary_size = 2 * channels + context_features

    def forward(
        self, image: torch.Tensor, visible: torch.Tensor, messages: torch.Tensor, context: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Patch tokens ``(b, G_h G_w, channels)`` and the summary ``(b, 2 channels + context)``; one batch dimension."""
        _, height, width = self.image_shape
        spread = patches_to_pixels(messages, self.patch_size, height, width)
        x = torch.cat([image, visible.unsqueeze(1).to(image.dtype), spread.to(image.dtype)], dim=1)
        for convolution in self.convolutions:
            x = F.relu(convolution(x))
        rows, columns = self.grid
        s = self.patch_size
        x = F.pad(x, (0, columns * s - width, 0, rows * s - height))
        patches = F.avg_pool2d(x, s).flatten(2).transpose(1, 2)  # (b, G_h G_w, channels)
        summary = torch.cat([patches.mean(1), patches.amax(1), context], dim=-1)
        return patches, summary


def _head(in_features: int, hidden: int, out_features: int) -> nn.Sequential:
    head = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
    nn.init.normal_(head[-1].weight, std=0.01)
    nn.init.zeros_(head[-1].bias)
    return head


def _flatten(image, visible, messages, context):
    lead = context.shape[:-1]
    b = math.prod(lead)
    return (
        image.reshape(b, *image.shape[-3:]),
        visible.reshape(b, *visible.shape[-2:]),
        messages.reshape(b, *messages.shape[-3:]),
        context.reshape(b, context.shape[-1]),
    )


class ImagePolicy(nn.Module):
    """Joint log-probabilities of the patches, reject and accept, in two stages (see the module docstring).

    At initialisation the three choices are about equally likely and so are the patches.
    """

    def __init__(self, body: ImageBody, head_size: int) -> None:
        super().__init__()
        self.body = body
        self.patch_head = _head(body.channels + body.summary_size, head_size, 1)
        self.decision_head = _head(body.summary_size, head_size, 3)

    def forward(self, image, visible, messages, context) -> torch.Tensor:
        lead = context.shape[:-1]
        patches, summary = self.body(*_flatten(image, visible, messages, context))
        tokens = torch.cat([patches, summary.unsqueeze(1).expand(-1, patches.shape[1], -1)], dim=-1)
        patch_log_p = self.patch_head(tokens).squeeze(-1).log_softmax(-1)
        continue_reject_accept = self.decision_head(summary).log_softmax(-1)
        logits = torch.cat([continue_reject_accept[:, :1] + patch_log_p, continue_reject_accept[:, 1:]], dim=-1)
        return logits.reshape(*lead, logits.shape[-1])


class ImageValue(nn.Module):
    """A scalar value from the summary."""

    def __init__(self, body: ImageBody, head_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = _head(body.summary_size, head_size, 1)

    def forward(self, image, visible, messages, context) -> torch.Tensor:
        lead = context.shape[:-1]
        _, summary = self.body(*_flatten(image, visible, messages, context))
        return self.head(summary).reshape(*lead, 1)


def build_image_agents(
    agent_names: tuple[str, ...],
    image_shape: tuple[int, int, int],
    patch_size: int,
    message_channels: int,
    context_features: int,
    sizes: dict,
) -> AgentModules:
    """Build the image agents: one body (or two: policy and value) and heads per agent.

    Parameters
    ----------
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    image_shape : tuple of int
        ``(C, H, W)`` of the images.
    patch_size : int
        Side of a patch; the action space is the patches, reject and accept.
    message_channels : int
        Steps x transcript agents (the channels of ``("agents", "messages")``).
    context_features : int
        Size of the one-hot step number.
    sizes : dict
        Per agent, an :class:`ImageAgentConfig`.
    """
    patches = math.prod(grid_shape(image_shape[1], image_shape[2], patch_size))
    policies, values = {}, {}
    for name in agent_names:
        size = sizes[name]

        def body() -> ImageBody:
            return ImageBody(image_shape, patch_size, message_channels, context_features, size.channels, size.conv_layers)

        policy_body = body()
        policies[name] = ImagePolicy(policy_body, size.head_size)
        values[name] = ImageValue(policy_body if size.shared_body else body(), size.head_size)
    return actor_critic_from_networks(
        agent_names,
        PerAgent(policies, AGENT_DIMS, active_only=True),
        PerAgent(values, AGENT_DIMS),
        IN_KEYS,
        distribution_class=GroupedMaskedCategorical,
        distribution_kwargs={"group_size": patches},
    )

