"""Zero-knowledge versions of the interactive-proof protocols: a second verifier and a simulator.

A proof protocol built with ``zero_knowledge: true`` (:class:`~nip_like.protocols.proof.ProofProtocol`)
has two more agents after its own: the second verifier ``adversarial_verifier``
and the ``simulator``. Each episode draws, with probability
``zk_adversarial_share``, whether the second verifier takes the verifier's place
in it. The provers cannot tell: the second verifier's messages reach them as
the verifier's would, so a prover that leaks something to one leaks it to the
other. In such an episode the simulator acts whenever the second verifier
does, but it sees only the instance and its own earlier messages, never a
prover's; it tries to send what the second verifier sends. The per-step
distance between the two (:func:`simulator_distance`) rewards the second
verifier, costs the simulator, and costs the provers
(:func:`zero_knowledge_rewards`), so that the provers are rewarded when the
simulator succeeds: when what they say lets the second verifier learn nothing
that the simulator could not produce without them.

The formulas are stated in the protocols documentation (``docs/concepts.rst``,
"Zero-knowledge protocols").
"""

from __future__ import annotations

import torch

from nip_like.distributions import masked_log_softmax

#: The second verifier, who tries to learn from the provers what the simulator cannot produce.
ADVERSARIAL_VERIFIER = "adversarial_verifier"
#: The simulator, who tries to reproduce the second verifier's messages without the provers.
SIMULATOR = "simulator"
#: The agents a zero-knowledge protocol adds after the base protocol's.
ZERO_KNOWLEDGE_AGENTS = (ADVERSARIAL_VERIFIER, SIMULATOR)
#: Protocol state: the second verifier plays in this episode, in the verifier's place.
ADVERSARIAL_KEY = "adversarial"


def simulator_distance(
    logits: torch.Tensor, mask: torch.Tensor, adversarial_index: int, simulator_index: int
) -> torch.Tensor:
    """Total-variation distance between the second verifier's and the simulator's action distributions.

    Parameters
    ----------
    logits : torch.Tensor
        ``(B, N, A)``: every agent's policy logits of the step.
    mask : torch.Tensor
        ``(B, N, A)`` booleans: the legal actions.
    adversarial_index, simulator_index : int
        Positions of the second verifier and the simulator in the agent dimension.

    Returns
    -------
    torch.Tensor
        ``(B,)`` floats in ``[0, 1]``: ``1/2 * sum_a |pi_v'(a) - pi_z(a)|``, each
        distribution the masked softmax of its agent's logits (what it samples from).
    """
    real = masked_log_softmax(logits[:, adversarial_index].float(), mask[:, adversarial_index]).exp()
    simulated = masked_log_softmax(logits[:, simulator_index].float(), mask[:, simulator_index]).exp()
    return 0.5 * (real - simulated).abs().sum(-1)


def zero_knowledge_rewards(
    rewards: torch.Tensor,
    adversarial: torch.Tensor,
    distance: torch.Tensor,
    adversarial_index: int,
    simulator_index: int,
    prover_indices: list[int],
    simulator_reward: float,
    prover_reward: float,
) -> torch.Tensor:
    """Per-agent rewards of one step of a zero-knowledge protocol.

    Parameters
    ----------
    rewards : torch.Tensor
        ``(B, N)``: the base protocol's rewards of the step (zeros for the two added agents).
    adversarial : torch.Tensor
        ``(B,)`` booleans: the second verifier plays in this episode.
    distance : torch.Tensor
        ``(B,)``: :func:`simulator_distance` where the second verifier acted this step, else 0.
    adversarial_index, simulator_index : int
        Positions of the second verifier and the simulator.
    prover_indices : list of int
        Positions of the provers.
    simulator_reward : float
        ``c_z``: the second verifier gets ``c_z * d``, the simulator ``-c_z * d``.
    prover_reward : float
        ``c_p``: each prover gets ``-c_p * d``.

    Returns
    -------
    torch.Tensor
        ``(B, N)``: the base rewards in the verifier's episodes; in the second
        verifier's, the zero-knowledge rewards alone (the verifier gets nothing).
    """
    zk = torch.zeros_like(rewards)
    zk[:, adversarial_index] = simulator_reward * distance
    zk[:, simulator_index] = -simulator_reward * distance
    zk[:, prover_indices] = -prover_reward * distance.unsqueeze(-1)
    return torch.where(adversarial.unsqueeze(-1), zk, rewards)
