"""Generate (or load from the cache) a graph-isomorphism dataset and summarise it.

Run it from the repository root::

    python scripts/generate_gi_dataset.py --name default --num-pairs 10000
    python scripts/generate_gi_dataset.py --name small --num-pairs 500 --seed 3 --cache-dir /tmp/gi

``--name`` picks a preset of :class:`~nip_like.scenarios.graph_isomorphism.data.GraphPairSpec`
fields (:data:`PRESETS`). The script prints the cache file, the counts per
label and per 1-WL stratum, and the wall time. Bad arguments print one line
``error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

from nip_like.cli import OneLineArgumentParser, run_dataset_command
from nip_like.errors import NipLikeError
from nip_like.scenarios.graph_isomorphism.data import (
    STRATUM_NAMES,
    GraphPairs,
    GraphPairSpec,
    cache_path,
    load_or_generate,
    wl_stratum,
)

#: Spec fields of each dataset name (``num_pairs`` and ``seed`` come from the command line).
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "small": {"min_nodes": 5, "max_nodes": 8},
}

DEFAULT_CACHE_DIR = Path("outputs") / "gi_data"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, choices=sorted(PRESETS), help="preset of spec fields")
    parser.add_argument("--num-pairs", required=True, type=int, help="number of graph pairs")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help=f"cache folder (default {DEFAULT_CACHE_DIR})"
    )
    return parser.parse_args(argv)


def summarise(pairs: GraphPairs) -> list[str]:
    """Return the lines describing the label and 1-WL stratum counts of ``pairs``."""
    strata = collections.Counter(wl_stratum(pairs.wl_rounds).tolist())
    rounds = collections.Counter(pairs.wl_rounds[~pairs.label].tolist())
    isomorphic = int(pairs.label.sum())
    lines = [f"pairs: {len(pairs)} (isomorphic {isomorphic}, non-isomorphic {len(pairs) - isomorphic})"]
    lines += [f"  {name}: {strata.get(stratum, 0)}" for stratum, name in STRATUM_NAMES.items()]
    by_round = ", ".join(f"{'never' if r < 0 else r}: {count}" for r, count in sorted(rounds.items(), key=_round_order))
    lines.append(f"non-isomorphic pairs by 1-WL round: {by_round or 'none'}")
    return lines


def _round_order(item: tuple[int, int]) -> float:
    return float("inf") if item[0] < 0 else item[0]


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parse_args(argv)
    try:
        spec = GraphPairSpec(num_pairs=args.num_pairs, seed=args.seed, **PRESETS[args.name])
    except NipLikeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    path = cache_path(spec, args.cache_dir)
    return run_dataset_command(path, lambda: load_or_generate(spec, args.cache_dir), summarise)


if __name__ == "__main__":
    sys.exit(main())
