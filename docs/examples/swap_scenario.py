"""A certificate task of your own: is one adjacent pair of a sorted list swapped?

Each list holds ``L`` distinct values in ``0 .. V-1`` in increasing order,
except that in half the lists one adjacent pair ``i, i+1`` is swapped. The
verifier sees only the cells that messages name; a prover arguing *accept*
names the swapped pair, which proves it: two cells out of order. The game,
its protocols, the language-model agents, the warm start, the metrics and
the transcripts are the duplicates scenario's; this file writes only what
differs (docs: own_scenario):

* :meth:`SwapScenario.generate`: how the lists are drawn (with their labels
  and certificates);
* :meth:`SwapScenario.verifier_accepts`: the sound decision rule that the
  verifier's warm start demonstrates;
* :meth:`SwapScenario.decoys`: what a prover without a certificate names
  (adjacent pairs, like a certificate, so that only the values tell);
* :class:`SwapConfig`: its name and the chat view's system prompts.

Run it from this folder (its YAML is ``scenario/swap.yaml``)::

    python -m nip_like --config-dir . preset=lm_quick scenario=swap_scenario.SwapScenario
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nip_like.registry import register_scenario
from nip_like.scenarios.duplicates.data import DuplicateLists, DuplicateSpec
from nip_like.scenarios.duplicates.scenario import DuplicatesConfig, DuplicatesScenario

PROMPTS = {
    "verifier": "Is an adjacent pair of the sorted list swapped? Answer accept or reject.",
    "accept": "Name the two swapped cells of the list: i j",
    "reject": "Name two adjacent cells of the list: i j",
}


@dataclass
class SwapConfig(DuplicatesConfig):
    """The duplicates scenario's options, for the swap task."""

    name: str = "swap"  # scenario name
    system_prompts: dict[str, str] = field(default_factory=lambda: dict(PROMPTS))  # chat: each role's system prompt


@register_scenario("swap", SwapConfig)
class SwapScenario(DuplicatesScenario):
    """Is one adjacent pair of a sorted list of distinct values swapped? The prover names the swap."""

    def generate(self, spec: DuplicateSpec) -> DuplicateLists:
        """``spec.num_lists`` sorted lists, ``spec.num_positives`` of them with one adjacent pair swapped."""
        generator = torch.Generator().manual_seed(spec.seed)
        count, length = spec.num_lists, spec.length
        values = torch.rand(count, spec.num_values, generator=generator).argsort(-1)[:, :length].sort(-1).values
        label = torch.zeros(count, dtype=torch.bool)
        label[torch.randperm(count, generator=generator)[: spec.num_positives]] = True
        first = torch.randint(length - 1, (count,), generator=generator)
        certificate = torch.stack([first, first + 1], -1)
        rows = label.nonzero().squeeze(-1)
        swapped = certificate[rows]
        values[rows.unsqueeze(-1), swapped] = values[rows.unsqueeze(-1), swapped.flip(-1)]
        certificate[~label] = -1
        return DuplicateLists(values=values, label=label, certificate=certificate)

    def verifier_accepts(self, values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Accept when two seen cells are out of order (only a swapped list has such a pair)."""
        before = values.unsqueeze(-1) > values.unsqueeze(-2)  # [b, i, j]: x_i > x_j
        both = seen.unsqueeze(-1) & seen.unsqueeze(-2)
        return (before & both).triu(1).flatten(1).any(-1)

    def decoys(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """A random adjacent pair, the later cell first, as a certificate is named."""
        first = torch.randint(length - 1, (count,), generator=generator)
        return torch.stack([first + 1, first], -1)
