"""Write a local chat-model folder (Qwen2, Llama or GPT-2 family) built offline, as a download would look.

The folder holds ``config.json``, ``model.safetensors``, ``generation_config.json``, a byte-level BPE
``tokenizer.json`` trained here on generated text, ``tokenizer_config.json`` and the chat template; point
``scenario.default_agent.pretrained_path`` (or ``scenario.agents.<name>.pretrained_path``) at it. The weights
are random: a stand-in for a pretrained model in shape, not in knowledge (see nip_like.lm.local_models).

Examples
--------
python scripts/build_lm_folder.py models/qwen2-tiny --family qwen2
python scripts/build_lm_folder.py models/qwen2-30m --family qwen2 --vocab-size 8000 --hidden-size 512 \
    --num-layers 6 --num-heads 8 --intermediate-size 1408
"""

from __future__ import annotations

import argparse
import sys

from nip_like.errors import ConfigError
from nip_like.lm.local_models import FAMILIES, build_chat_model_folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to write the model folder")
    parser.add_argument("--family", default="qwen2", choices=sorted(FAMILIES), help="model family (default qwen2)")
    parser.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary (default 2000)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--context", type=int, default=2048, help="max_position_embeddings (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "context"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hidden_size % args.num_heads:
        parser.error(f"--hidden-size ({args.hidden_size}) must be a multiple of --num-heads ({args.num_heads})")
    try:
        folder = build_chat_model_folder(
            args.folder, args.family, args.vocab_size, args.hidden_size, args.num_layers, args.num_heads,
            args.intermediate_size, args.context, args.seed,
        )
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
