"""Honest play of the image-classification game, recorded as demonstrations for a warm start.

A prover that argues for *accept* shows the verifier the evidence for the
positive class: the patch, among those not yet revealed, whose pixels make
the positive class most likely against the negative one. A prover that
argues for *reject* shows the patch that makes it least likely. The evidence
of a patch (:class:`PixelEvidence`) is the log-likelihood ratio of its pixels
under a per-pixel Gaussian model of each class (the classes' means and their
pooled variance per pixel), fitted on the train split: on an image of the
positive class the accept-side prover's patches are where the image looks
most like its class, on an image of the negative class they are the most
positive-looking parts, which a verifier must learn to weigh.

:func:`play_demonstrations` plays every image of a split through the
environment's own rules: until its last turn, when it decides, the verifier
reveals the patch, among those not yet revealed to it, on which the classes
differ most whatever the image (:meth:`PixelEvidence.patch_information`), and
at every step where it may decide it is shown the right decision too; every
prover plays its side as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from nip_like.protocols.zero_knowledge import ADVERSARIAL_KEY

#: Added to each pixel's pooled variance, so that pixels that never change weigh nothing.
VARIANCE_FLOOR = 1e-2


@dataclass
class PixelEvidence:
    """A per-pixel Gaussian model of each class, and the evidence of each patch for the positive one.

    Attributes
    ----------
    mean : torch.Tensor
        ``(2, C, H, W)``: each class's mean pixel values in ``[0, 1]`` (negative first).
    variance : torch.Tensor
        ``(C, H, W)``: the pooled within-class variance of each pixel, plus :data:`VARIANCE_FLOOR`.
    """

    mean: torch.Tensor
    variance: torch.Tensor

    @classmethod
    def fit(cls, images: torch.Tensor, label: torch.Tensor) -> "PixelEvidence":
        """Fit the model to ``(N, C, H, W)`` uint8 images and their ``(N,)`` bool labels (both classes present)."""
        x = images.float() / 255
        means = torch.stack([x[~label].mean(0), x[label].mean(0)])
        residual = x - means[label.long()]
        return cls(means, residual.pow(2).mean(0) + VARIANCE_FLOOR)

    def pixel_evidence(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, H, W)``: the log-likelihood ratio, positive against negative, of each pixel of ``(B, C, H, W)`` images in ``[0, 1]``."""
        mean = self.mean.to(images)
        negative, positive = (images - mean[0]).pow(2), (images - mean[1]).pow(2)
        return ((negative - positive) / (2 * self.variance.to(images))).sum(1)

    def patch_evidence(self, images: torch.Tensor, patch_size: int, grid: tuple[int, int]) -> torch.Tensor:
        """``(B, G_h G_w)``: the summed evidence of each patch's pixels (row by row)."""
        return _patch_sums(self.pixel_evidence(images), patch_size, grid)

    def patch_information(self, patch_size: int, grid: tuple[int, int]) -> torch.Tensor:
        """``(G_h G_w,)``: how far apart the classes are on each patch, whatever the image.

        The sum over the patch's pixels and channels of ``(mean_1 - mean_0)^2
        / variance``: twice the symmetric divergence of the two classes'
        Gaussians on the patch. The patches a verifier who has seen nothing
        learns most from, on average.
        """
        separation = ((self.mean[1] - self.mean[0]).pow(2) / self.variance).sum(0)
        return _patch_sums(separation.unsqueeze(0), patch_size, grid)[0]


def _patch_sums(pixels: torch.Tensor, patch_size: int, grid: tuple[int, int]) -> torch.Tensor:
    """``(B, H, W) -> (B, G_h G_w)``: the sum over each patch's pixels (row by row)."""
    rows, columns = grid
    height, width = pixels.shape[-2:]
    padded = F.pad(pixels.unsqueeze(1), (0, columns * patch_size - width, 0, rows * patch_size - height))
    return F.avg_pool2d(padded, patch_size, divisor_override=1).flatten(1)


def honest_patches(evidence: torch.Tensor, seen: torch.Tensor, accept_side: bool) -> torch.Tensor:
    """``(B,)``: the patch an honest prover sends, the most (or least) positive of those not yet seen.

    Parameters
    ----------
    evidence : torch.Tensor
        ``(B, P)``: each patch's evidence for the positive class.
    seen : torch.Tensor
        ``(B, P)`` bool: the patches the prover knows to be revealed already
        (any patch when all are).
    accept_side : bool
        Whether the prover argues for *accept* (the largest evidence) or *reject* (the smallest).
    """
    signed = evidence if accept_side else -evidence
    fresh = ~seen | seen.all(-1, keepdim=True)
    return torch.where(fresh, signed, torch.full_like(signed, -torch.inf)).argmax(-1)


def play_demonstrations(env, protocol, images, episodes_per_image: int, generator: torch.Generator, evidence: PixelEvidence, accepts: torch.Tensor | None = None) -> dict[str, TensorDict]:
    """Play every image ``episodes_per_image`` times honestly; return each demonstrated agent's datapoints.

    Parameters
    ----------
    env : ImageClassificationEnv
        An environment on the CPU (its rules, observations and masks are used; its data are not).
    protocol : Protocol
        The protocol (turns, sides).
    images : LabelledImages
        The split's images.
    episodes_per_image : int
        Episodes played on each image (they differ only where the protocol draws, as a speaker).
    generator : torch.Generator
        Draws the protocol's own state (a drawn speaker).
    evidence : PixelEvidence
        The class model: the evidence the provers show, the information the verifier looks for.
    accepts : torch.Tensor, optional
        ``(len(images),)`` bool: the decision the verifier is shown; by default the label.

    Returns
    -------
    dict of str to TensorDict
        For the verifier (at every step where it may decide: the decision; at
        every turn before its last: the patch it sends) and each prover (at
        every step where it acts): batch ``(E,)`` with ``"agents"`` (every
        agent's observation entries, ``"active"`` set for the demonstrated
        agent alone), ``"target_action"``, ``"target_mask"`` (reject and accept
        for a decision, every legal action for the verifier's patch, the legal
        patches for a prover's) and ``"label"``.
    """
    count = len(images) * episodes_per_image
    index = torch.arange(len(images)).repeat(episodes_per_image)
    state = env.new_state(index)
    state["round"] = torch.zeros(count, dtype=torch.int64)
    state.update(protocol.initial_state(count, generator))
    if env.zero_knowledge:
        # Honest play is the verifier's: no episode is the second verifier's, and the simulator waits.
        state[ADVERSARIAL_KEY] = torch.zeros(count, dtype=torch.bool)
    agents, verifier, patches = protocol.num_agents, protocol.verifier_index, env.num_positions
    names = protocol.transcript_agent_names
    provers = [position for position in range(len(names)) if position != verifier]
    patch_evidence = evidence.patch_evidence(state["image"], env.patch_size, env.grid)
    information = evidence.patch_information(env.patch_size, env.grid).unsqueeze(0)
    accepted = state["label"] if accepts is None else accepts.bool()[index]
    decision = torch.where(accepted, env.accept_action, env.reject_action)
    collected: dict[int, list[TensorDict]] = {position: [] for position in range(agents)}

    def record(position: int, rows: torch.Tensor, target: torch.Tensor, target_mask: torch.Tensor) -> None:
        active = torch.zeros(len(rows), agents, dtype=torch.bool)
        active[:, position] = True
        entries = {key: value[rows] for key, value in extra.items()}
        collected[position].append(
            TensorDict(
                {
                    "agents": TensorDict(
                        {**entries, "observation": observation[rows], "active": active}, batch_size=[len(rows), agents]
                    ),
                    "target_action": target,
                    "target_mask": target_mask,
                    "label": state["label"][rows],
                },
                batch_size=[len(rows)],
            )
        )

    for _ in range(protocol.num_rounds):
        active = protocol.active_agents_in(state)
        observation, mask = env._observe(state)
        extra = env._observe_extra(state)
        seen = extra["messages"].sum(2).flatten(2) > 0  # (B, N, P): the patches each agent has read
        action = torch.zeros(count, agents, dtype=torch.int64)
        # The verifier: shown the right decision wherever it may decide; it decides only when it must.
        acting = active[:, verifier]
        rows = (acting & mask[:, verifier, patches:].any(-1)).nonzero().flatten()
        if len(rows):
            choices = torch.zeros(len(rows), env.num_actions, dtype=torch.bool)
            choices[:, [env.reject_action, env.accept_action]] = True
            record(verifier, rows, decision[rows], choices)
        must = acting & ~mask[:, verifier, :patches].any(-1)
        looks = honest_patches(information.expand(count, -1), seen[:, verifier], accept_side=True)
        action[:, verifier] = torch.where(must, decision, looks)
        # Before its last turn it looks on: it sends its patch rather than deciding (any legal action is a choice).
        rows = (acting & ~must).nonzero().flatten()
        if len(rows):
            record(verifier, rows, action[rows, verifier], mask[rows, verifier])
        # The provers: each shows the evidence for its side.
        for position in provers:
            accept_side = protocol.prover_sides.get(names[position], True)
            action[:, position] = honest_patches(patch_evidence, seen[:, position], accept_side)
            rows = active[:, position].nonzero().flatten()
            if len(rows):
                record(position, rows, action[rows, position], mask[rows, position])
        state, _, _ = env._advance(state.clone(), action, active)
        state["round"] = state["round"] + 1
    return {protocol.agent_names[position]: torch.cat(parts) for position, parts in collected.items() if parts}
