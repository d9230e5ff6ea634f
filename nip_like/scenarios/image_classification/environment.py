"""The image-classification environment: provers reveal parts of an image to a verifier who sees nothing else.

Each episode draws an image from a dataset of labelled images
(:class:`~nip_like.scenarios.image_classification.data.LabelledImages`). The
image is cut into a grid of ``G_h x G_w`` patches of ``s x s`` pixels
(``s = patch_size``; the last row and column of patches are cut short when
``s`` does not divide the image). An action is one of ``G_h G_w + 2``: a
patch (``0 .. G_h G_w - 1``, row by row), *reject* (``G_h G_w``) or *accept*
(``G_h G_w + 1``).

A message is a patch. Sending it *reveals* that patch's pixels to every agent
that reads the message (the protocol's channels at that step,
:func:`~nip_like.protocols.multi_channel.message_visibility`), the sender
included. The provers see the whole image. With ``verifier_view: revealed``
(the default) the verifier sees only the pixels of the patches revealed to it,
by the provers' messages and by its own: alone it sees nothing. With
``verifier_view: full`` it sees the whole image too, as in the NIP
reference, where every agent sees the image and a message names a latent
pixel. Provers send patches; the verifier sends a patch (and so lets the
turn pass) or decides, when the protocol allows, and must decide on its last
turn.

Per-agent entries (``B`` episodes, ``N`` agents, ``M`` transcript agents,
``T`` steps, ``C x H x W`` images):

====================================  =======================  ==========================================
key                                   shape                    meaning
====================================  =======================  ==========================================
``("agents", "image")``               ``B, N, C, H, W``        the pixels the agent sees, in ``[0, 1]``;
                                                               0 where they are hidden from it
``("agents", "visible")``             ``B, N, H, W``           which pixels the agent sees (bool)
``("agents", "messages")``            ``B, N, T*M, G_h, G_w``  the messages the agent read: entry
                                                               ``[t*M + j, r, c]`` is 1 if agent ``j``
                                                               sent patch ``(r, c)`` at step ``t`` and the
                                                               agent reads ``j``'s message of step ``t``
``("agents", "observation")``         ``B, N, T + 1``          one-hot step number (``T``: finished)
``("agents", "action_mask")``         ``B, N, G_h G_w + 2``    legal actions
====================================  =======================  ==========================================

State (under ``"state"``): ``image_index``, ``image`` (``B, C, H, W`` in
``[0, 1]``), ``label`` (True: the positive class, the verifier should
accept), ``sent`` (``B, T, M`` patches, -1 for none) and ``decision`` (-1
none, 0 reject, 1 accept).

Zero-knowledge protocols (``protocol.zero_knowledge=true``): as in the
graph-isomorphism game, the transcript holds the base protocol's ``M``
agents, the second verifier's patches and decision take the verifier's place
in its episodes (so the provers read them as the verifier's) and it sees the
verifier's view; the simulator's patches are kept apart (``simulated``, ``B,
T``) and it sees only the patches it sent itself. Each step of the second
verifier adds the distance between its action distribution and the
simulator's to ``zk_distance`` and one to ``zk_turns``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Binary, Unbounded

from nip_like.keys import ACTION_MASK_KEY, LOGITS_KEY
from nip_like.protocols.multi_channel import message_visibility
from nip_like.protocols.zero_knowledge import ADVERSARIAL_KEY
from nip_like.scenarios.environment import InteractionEnv

#: How the verifier sees the image: only the revealed patches, or all of it (the NIP reference's).
VERIFIER_VIEWS = ("revealed", "full")


def grid_shape(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """``(G_h, G_w)``: the patches of ``patch_size x patch_size`` pixels that cover a ``height x width`` image."""
    return math.ceil(height / patch_size), math.ceil(width / patch_size)


def patches_to_pixels(cells: torch.Tensor, patch_size: int, height: int, width: int) -> torch.Tensor:
    """``(..., G_h, G_w) -> (..., H, W)``: each patch's value on each of its pixels."""
    pixels = cells.repeat_interleave(patch_size, -2).repeat_interleave(patch_size, -1)
    return pixels[..., :height, :width]


def message_history(sent: torch.Tensor, visibility: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``(B, M, T*M, G_h, G_w)``: what each transcript agent read of the messages ``sent``.

    Parameters
    ----------
    sent : torch.Tensor
        ``(B, T, M)``: the patch each agent sent at each step, -1 for none.
    visibility : torch.Tensor
        ``(T, M, M)`` bool: ``[t, i, j]``, agent ``i`` reads agent ``j``'s message of step ``t``.
    grid : tuple of int
        ``(G_h, G_w)``.
    """
    batch, steps, agents = sent.shape
    positions = grid[0] * grid[1]
    one_hot = F.one_hot((sent + 1).clamp(min=0), positions + 1)[..., 1:].float()  # (B, T, M_sender, P)
    seen = torch.einsum("btjp,tij->bitjp", one_hot, visibility.to(one_hot))
    return seen.reshape(batch, agents, steps * agents, *grid)


def revealed_patches(sent: torch.Tensor, visibility: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``(B, M, G_h, G_w)`` bool: the patches revealed to each transcript agent by the messages it read."""
    return message_history(sent, visibility, grid).sum(2) > 0


class ImageClassificationEnv(InteractionEnv):
    """Vectorised image-classification interactive proof (see the module docstring).

    Parameters
    ----------
    protocol : ProofProtocol or MultiChannelTestProtocol
        Turns, channels and rewards.
    images : torch.Tensor
        ``(P, C, H, W)`` uint8: the dataset's images.
    label : torch.Tensor
        ``(P,)`` bool: True for the positive class.
    num_envs : int
        Parallel episodes.
    device : torch.device or str
        Where the tensors live (the dataset is moved there, as uint8).
    seed : int
        Seed of the environment's generator.
    group_size : int
        Consecutive environments that play the same image.
    patch_size : int
        Side of a patch, in pixels.
    verifier_view : str
        ``"revealed"`` or ``"full"`` (:data:`VERIFIER_VIEWS`).
    """

    def __init__(
        self,
        protocol,
        images: torch.Tensor,
        label: torch.Tensor,
        num_envs: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
        patch_size: int = 1,
        verifier_view: str = "revealed",
    ) -> None:
        if verifier_view not in VERIFIER_VIEWS:
            raise ValueError(f"verifier_view must be one of {list(VERIFIER_VIEWS)}, got {verifier_view!r}")
        self.image_shape = tuple(int(size) for size in images.shape[1:])
        self.patch_size = int(patch_size)
        self.grid = grid_shape(self.image_shape[1], self.image_shape[2], self.patch_size)
        self.num_positions = self.grid[0] * self.grid[1]
        self.num_images = int(images.shape[0])
        self.verifier_view = verifier_view
        self.verifier_index = protocol.verifier_index
        self.num_steps = protocol.num_rounds
        self.zero_knowledge = protocol.zero_knowledge
        self.transcript_agents = len(protocol.transcript_agent_names)
        self.visibility = message_visibility(protocol).bool()
        self._step_policy: tuple[torch.Tensor | None, torch.Tensor] | None = None
        super().__init__(
            protocol,
            num_envs=num_envs,
            num_actions=self.num_positions + 2,
            observation_size=protocol.num_rounds + 1,
            device=device,
            seed=seed,
            group_size=group_size,
        )
        self.data = {"images": images.to(self.device, torch.uint8), "label": label.to(self.device, torch.bool)}
        self.visibility = self.visibility.to(self.device)
        # Which agents see only what was revealed to them: the verifier, and in a zero-knowledge protocol the two added.
        hidden = torch.zeros(self.num_agents, dtype=torch.bool)
        if verifier_view == "revealed":
            hidden[self.verifier_index] = True
            hidden[self.transcript_agents :] = True
        self.sees_revealed_only = hidden.to(self.device)

    @property
    def reject_action(self) -> int:
        """The verifier's *reject* action."""
        return self.num_positions

    @property
    def accept_action(self) -> int:
        """The verifier's *accept* action."""
        return self.num_positions + 1

    # ----------------------------------------------------------------- specs
    def _state_spec(self) -> dict[str, object]:
        b, device = self.batch_size, self.device
        return {
            "image_index": Unbounded(shape=b, dtype=torch.int64, device=device),
            "image": Unbounded(shape=(*b, *self.image_shape), device=device),
            "label": Binary(shape=b, dtype=torch.bool, device=device),
            "sent": Unbounded(shape=(*b, self.num_steps, self.transcript_agents), dtype=torch.int64, device=device),
            "decision": Unbounded(shape=b, dtype=torch.int64, device=device),
            **(
                {
                    "simulated": Unbounded(shape=(*b, self.num_steps), dtype=torch.int64, device=device),
                    "zk_distance": Unbounded(shape=b, device=device),
                    "zk_turns": Unbounded(shape=b, dtype=torch.int64, device=device),
                }
                if self.zero_knowledge
                else {}
            ),
        }

    def _agent_observation_spec(self) -> dict[str, object]:
        agents, device = (*self.batch_size, self.num_agents), self.device
        _, height, width = self.image_shape
        return {
            "image": Unbounded(shape=(*agents, *self.image_shape), device=device),
            "visible": Binary(shape=(*agents, height, width), dtype=torch.bool, device=device),
            "messages": Unbounded(shape=(*agents, self.num_steps * self.transcript_agents, *self.grid), device=device),
        }

    # ------------------------------------------------------------ the game
    def new_state(self, index: torch.Tensor) -> TensorDict:
        """The state at the start of episodes on the images ``index`` (a ``(B,)`` long tensor); no protocol entries."""
        index = index.to(self.device)
        count = index.shape[0]
        return TensorDict(
            {
                "image_index": index,
                "image": self.data["images"][index].float() / 255,
                "label": self.data["label"][index],
                "sent": torch.full((count, self.num_steps, self.transcript_agents), -1, device=self.device),
                "decision": torch.full((count,), -1, device=self.device),
                **(self._new_zero_knowledge_state(count) if self.zero_knowledge else {}),
            },
            batch_size=[count],
            device=self.device,
        )

    def _new_state(self, num_episodes: int) -> TensorDict:
        return self.new_state(torch.randint(0, self.num_images, (num_episodes,), generator=self.rng))

    def _new_zero_knowledge_state(self, num_episodes: int) -> dict[str, torch.Tensor]:
        return {
            "simulated": torch.full((num_episodes, self.num_steps), -1, device=self.device),
            "zk_distance": torch.zeros(num_episodes, device=self.device),
            "zk_turns": torch.zeros(num_episodes, dtype=torch.int64, device=self.device),
        }

    def _observe(self, state: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        round_index = state["round"]
        batch = round_index.shape[0]
        observation = F.one_hot(round_index.clamp(max=self.num_steps), self.num_steps + 1).float()
        observation = observation.unsqueeze(1).expand(batch, self.num_agents, -1)
        patches = self.num_positions
        may_decide = self.protocol.may_decide(round_index)
        must_decide = round_index >= self.num_steps - 1
        mask = torch.zeros(batch, self.transcript_agents, self.num_actions, dtype=torch.bool, device=round_index.device)
        mask[..., :patches] = True
        verifier = self.verifier_index
        mask[:, verifier, :patches] = ~must_decide.unsqueeze(-1)
        mask[:, verifier, patches:] = (may_decide | must_decide).unsqueeze(-1)
        if self.zero_knowledge:
            # The second verifier and the simulator choose as the verifier does.
            mask = torch.cat([mask, mask[:, [verifier, verifier]]], dim=1)
        return observation.contiguous(), mask

    def read_messages(self, state: TensorDictBase) -> torch.Tensor:
        """``(B, N, T*M, G_h, G_w)``: the messages each agent read (the ``messages`` entry)."""
        history = message_history(state["sent"], self.visibility, self.grid)
        if self.zero_knowledge:
            # The second verifier reads what the verifier would; the simulator only its own patches, in the verifier's place.
            alone = torch.full_like(state["sent"], -1)
            alone[..., self.verifier_index] = state["simulated"]
            simulated = message_history(alone, self.visibility, self.grid)[:, self.verifier_index]
            history = torch.cat([history, history[:, self.verifier_index].unsqueeze(1), simulated.unsqueeze(1)], dim=1)
        return history

    def _observe_extra(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        messages = self.read_messages(state)
        _, height, width = self.image_shape
        revealed = patches_to_pixels(messages.sum(2) > 0, self.patch_size, height, width)  # (B, N, H, W)
        visible = revealed | ~self.sees_revealed_only.view(1, -1, 1, 1)
        image = state["image"].unsqueeze(1) * visible.unsqueeze(2).to(state["image"].dtype)
        return {"image": image, "visible": visible, "messages": messages}

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        # A zero-knowledge protocol rewards the distance between two agents' action distributions:
        # keep the policy's logits and masks of the step for _advance.
        if self.zero_knowledge:
            self._step_policy = (tensordict.get(LOGITS_KEY, None), tensordict.get(ACTION_MASK_KEY))
        try:
            return super()._step(tensordict)
        finally:
            self._step_policy = None

    def _zero_knowledge_step(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Put the second verifier in the verifier's place and record the simulator's patch.

        Returns the transcript's actions and active flags and the step's
        simulator distance (0 where the second verifier did not act).
        """
        protocol = self.protocol
        verifier, adversary, simulator = self.verifier_index, protocol.adversarial_index, protocol.simulator_index
        adversarial = state[ADVERSARIAL_KEY]
        transcript_action = action[:, : self.transcript_agents].clone()
        transcript_active = active[:, : self.transcript_agents].clone()
        transcript_action[:, verifier] = torch.where(adversarial, action[:, adversary], action[:, verifier])
        transcript_active[:, verifier] = active[:, verifier] | active[:, adversary]
        step = state["round"].clamp(max=self.num_steps - 1)
        sent = active[:, simulator] & (action[:, simulator] < self.num_positions)
        simulated = torch.where(sent, action[:, simulator], -1)
        state["simulated"] = state["simulated"].scatter(1, step.view(-1, 1), simulated.unsqueeze(1))
        acted = active[:, adversary]
        distance = torch.zeros(action.shape[0], device=action.device)
        if acted.any():
            logits, mask = self._step_policy if self._step_policy is not None else (None, None)
            if logits is None:
                raise RuntimeError(
                    "a zero-knowledge protocol needs the policy's ('agents', 'logits') in each step's input "
                    "to measure the simulator's distance; step the environment with the agents' policy"
                )
            distance = torch.where(acted, protocol.simulator_distance(logits, mask), distance)
        state["zk_distance"] = state["zk_distance"] + distance
        state["zk_turns"] = state["zk_turns"] + acted.long()
        return transcript_action, transcript_active, distance

    def _advance(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        if self.zero_knowledge:
            action, active, distance = self._zero_knowledge_step(state, action, active)
        patch_action = action < self.num_positions
        verifier_acted = active[:, self.verifier_index]
        decided = verifier_acted & ~patch_action[:, self.verifier_index]
        accept = action[:, self.verifier_index] == self.accept_action
        # Record each active agent's patch; a decision is not a message.
        step = state["round"].clamp(max=self.num_steps - 1)
        sent = torch.where(active & patch_action, action, torch.full_like(action, -1))
        index = step.view(-1, 1, 1).expand(-1, 1, self.transcript_agents)
        state["sent"] = state["sent"].scatter(1, index, sent.unsqueeze(1))
        state["decision"] = torch.where(decided, accept.long(), state["decision"])
        reward = self.protocol.step_rewards(decided, accept, state["label"], verifier_acted)
        if self.zero_knowledge:
            reward = self.protocol.zero_knowledge_rewards(reward, state[ADVERSARIAL_KEY], distance)
        return state, reward, decided
