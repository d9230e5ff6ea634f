"""Generate (or load from the cache) a duplicates dataset and summarise it.

Run it from the repository root::

    python scripts/generate_duplicates_dataset.py
    python scripts/generate_duplicates_dataset.py --num-lists 500 --length 6 --num-values 12 --cache-dir /tmp/d

Every option is a field of
:class:`~nip_like.scenarios.duplicates.data.DuplicateSpec` (its defaults:
4000 lists of 8 values in 0..15, half of them with a duplicate). The script
prints the cache file, the counts per label, how often each position belongs
to the duplicate pair, the best accuracy of a verifier that sees k cells
without a prover, and the wall time. Bad arguments print one line
``error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from nip_like.cli import OneLineArgumentParser, run_dataset_command
from nip_like.errors import NipLikeError
from nip_like.scenarios.duplicates.data import (
    DuplicateLists,
    DuplicateSpec,
    cache_path,
    load_or_generate,
    solo_verifier_accuracy,
)

DEFAULT_CACHE_DIR = Path("outputs") / "duplicates_data"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = DuplicateSpec()
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    for field, kind, meaning in (
        ("num_lists", int, "number of lists"),
        ("length", int, "values per list (L)"),
        ("num_values", int, "values are 0..V-1 (V)"),
        ("seed", int, "generator seed"),
        ("positive_fraction", float, "fraction of lists with a duplicate"),
    ):
        default = getattr(defaults, field)
        flag = "--" + field.replace("_", "-")
        parser.add_argument(flag, type=kind, default=default, help=f"{meaning} (default {default})")
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help=f"cache folder (default {DEFAULT_CACHE_DIR})"
    )
    return parser.parse_args(argv)


def summarise(lists: DuplicateLists, spec: DuplicateSpec) -> list[str]:
    """Return the lines describing the labels, the duplicate positions and the solo-verifier bound."""
    positives = int(lists.label.sum())
    distinct = len(torch.unique(lists.values, dim=0))
    lines = [
        f"lists: {len(lists)} of {lists.length} values in 0..{spec.num_values - 1} "
        f"(with a duplicate {positives}, without {len(lists) - positives}; {distinct} distinct)"
    ]
    positions = torch.bincount(lists.certificate[lists.label].flatten(), minlength=lists.length)
    lines.append(f"cells of the duplicate pairs by position 0..{lists.length - 1}: {positions.tolist()}")
    bound = ", ".join(
        f"k={k}: {solo_verifier_accuracy(spec.length, k, spec.positive_fraction):.3f}"
        for k in range(spec.length + 1)
    )
    lines.append(f"best accuracy of a verifier alone that sees k cells: {bound}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parse_args(argv)
    try:
        spec = DuplicateSpec(
            num_lists=args.num_lists,
            length=args.length,
            num_values=args.num_values,
            seed=args.seed,
            positive_fraction=args.positive_fraction,
        )
    except NipLikeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    path, load = cache_path(spec, args.cache_dir), lambda: load_or_generate(spec, args.cache_dir)
    return run_dataset_command(path, load, lambda lists: summarise(lists, spec))


if __name__ == "__main__":
    sys.exit(main())
