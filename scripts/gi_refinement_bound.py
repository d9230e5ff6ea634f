"""How far can a verifier that refines colours for a few rounds get, with and without a prover?

A graph-isomorphism verifier whose network does ``R`` rounds of message
passing sees, at best, what ``R`` rounds of 1-WL colour refinement see. This
script computes, on the scenario's held-out test pairs, the accuracy such a
verifier could reach in an interactive proof with ``K`` exchanges:

* The verifier sends ``K`` nodes of the first graph, one at a time, each drawn
  uniformly at random; after each, the prover answers with a node of the
  second graph. The verifier refines both graphs jointly for ``R`` rounds with
  every query-answer pair individualised in a colour of its own
  (:func:`~nip_like.scenarios.graph_isomorphism.isomorphism.wl_rounds_to_distinguish`
  with ``marks``) and rejects when the colour histograms differ.
* On an isomorphic pair a faithful prover answers with images, which never
  differ: the verifier accepts. On a non-isomorphic pair the prover answers,
  knowing the past queries but not the next ones, so as to maximise its
  chance of never being noticed. That probability is computed exactly (the
  mean over queries of the best answer's value, recursively).

The accuracy bound is the share of isomorphic pairs plus the share of
non-isomorphic pairs times the probability of catching the prover. It is a
reference point, not a guarantee: a verifier that chooses its nodes (rather
than drawing them) can do better, attention adds to what refinement sees, and
a network that is not trained to its limit does worse. With ``K = 0`` it is the
accuracy of the verifier alone.

Run it from the repository root::

    python scripts/gi_refinement_bound.py                                # paper preset, R = 2, K = 0, 1, 2
    python scripts/gi_refinement_bound.py --rounds 5 --exchanges 0 1 --pairs 0   # every pair
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from nip_like.scenarios.graph_isomorphism.isomorphism import WL_NEVER, wl_rounds_to_distinguish  # noqa: E402


def undetected(adj_a: np.ndarray, adj_b: np.ndarray, rounds: int, exchanges: int, marks: list) -> float:
    """Probability that a best-answering prover survives ``exchanges`` more random queries.

    Parameters
    ----------
    adj_a, adj_b : numpy.ndarray
        The two graphs (no padding).
    rounds : int
        Refinement rounds of the verifier.
    exchanges : int
        Queries still to come.
    marks : list of (int, int)
        The query-answer pairs so far.
    """
    if wl_rounds_to_distinguish(adj_a, adj_b, max_rounds=rounds, marks=marks) is not None:
        return 0.0
    if exchanges == 0:
        return 1.0
    total = 0.0
    for query in range(adj_a.shape[0]):
        best = 0.0
        for answer in range(adj_b.shape[0]):
            best = max(best, undetected(adj_a, adj_b, rounds, exchanges - 1, [*marks, (query, answer)]))
            if best == 1.0:
                break
        total += best
    return total / adj_a.shape[0]


def load_split(overrides: list[str], split: str):
    """The scenario's ``split`` pairs for a composed experiment config."""
    from nip_like.cli import compose_config
    from nip_like.validation import build_scenario

    return build_scenario(compose_config(overrides)).splits()[split]


#: Column of each 1-WL stratum (pairs told apart in 3 or more rounds share one).
STRATA = {1: "1", 2: "2", WL_NEVER: "never"}


def main(argv: list[str] | None = None) -> list[dict]:
    """Compute and print the bounds; return one row per number of exchanges."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="paper", help="the experiment preset whose dataset is used")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"], help="which split")
    parser.add_argument("--rounds", type=int, default=2, help="refinement rounds of the verifier")
    parser.add_argument("--exchanges", type=int, nargs="+", default=[0, 1, 2], help="numbers of exchanges")
    parser.add_argument("--pairs", type=int, default=150, help="non-isomorphic pairs drawn at random (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw")
    parser.add_argument("overrides", nargs="*", help="further config overrides, e.g. scenario.num_pairs=2000")
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.exchanges) < 0 or args.pairs < 0:
        parser.error("--rounds must be at least 1, --exchanges and --pairs at least 0")

    pairs = load_split([f"preset={args.preset}", *args.overrides], args.split)
    labels = pairs.label.numpy()
    non_isomorphic = [i for i in range(len(labels)) if not labels[i]]
    random.Random(args.seed).shuffle(non_isomorphic)
    drawn = non_isomorphic[: args.pairs] if args.pairs else non_isomorphic
    share_isomorphic = float(labels.mean())
    print(
        f"{args.split} split of preset={args.preset}: {len(labels)} pairs, {share_isomorphic:.0%} isomorphic; "
        f"{len(drawn)} of {len(non_isomorphic)} non-isomorphic pairs, {args.rounds} refinement rounds"
    )
    return bound_rows(args, pairs, drawn, share_isomorphic)


def _graphs(pairs, index: int) -> tuple[np.ndarray, np.ndarray]:
    n = int(pairs.num_nodes[index])
    return pairs.adjacency[index, 0, :n, :n].numpy(), pairs.adjacency[index, 1, :n, :n].numpy()


def bound_rows(args: argparse.Namespace, pairs, drawn: list[int], share_isomorphic: float) -> list[dict]:
    """Print and return the accuracy bound for each number of exchanges in ``args.exchanges``."""
    print(f"{'exchanges':>9} {'undetected':>10} {'by 1-WL rounds (1 / 2 / >2 / never)':>38} {'accuracy':>9} {'seconds':>8}")
    rows = []
    for exchanges in args.exchanges:
        started = time.perf_counter()
        by_stratum: dict[str, list[float]] = {}
        for index in drawn:
            adj_a, adj_b = _graphs(pairs, index)
            stratum = STRATA.get(int(pairs.wl_rounds[index]), ">2")
            by_stratum.setdefault(stratum, []).append(undetected(adj_a, adj_b, args.rounds, exchanges, []))
        values = [value for stratum in by_stratum.values() for value in stratum]
        mean = float(np.mean(values))
        accuracy = share_isomorphic + (1 - share_isomorphic) * (1 - mean)
        strata = " / ".join(
            f"{np.mean(by_stratum[name]):.2f}" if name in by_stratum else "-" for name in ("1", "2", ">2", "never")
        )
        seconds = time.perf_counter() - started
        rows.append({"exchanges": exchanges, "undetected": mean, "accuracy": accuracy, "seconds": seconds})
        print(f"{exchanges:>9} {mean:>10.3f} {strata:>38} {accuracy:>9.3f} {seconds:>8.1f}")
    return rows


if __name__ == "__main__":
    main()
