"""The learning curve of one LM agent's supervised warm start on the duplicates task.

Fine-tunes the agent (by default the prover) on the scenario's honest demonstrations
(:meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.demonstrations`) and prints,
after every epoch, the train loss per token and the held-out (val) loss and greedy reproduction
rate: the share of val demonstrations whose every token the agent's greedy decoding reproduces,
which for the prover is the share of positive lists on which it names the duplicate pair.

Examples
--------
python scripts/lm_warm_start_curve.py --epochs 30 --hidden-size 128 --num-layers 4
python scripts/lm_warm_start_curve.py --length 4 --device cuda --json curve.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from omegaconf import OmegaConf

from nip_like.lm.demonstration_fit import demonstration_loss, held_out_scores
from nip_like.registry import PROTOCOLS
from nip_like.scenarios.duplicates.scenario import DuplicatesConfig, DuplicatesScenario
from nip_like.supervised import supervised_epoch, warmup_schedule


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", default="prover", help="the agent to fine-tune (default: prover)")
    parser.add_argument("--protocol", default="nip", help="the proof protocol whose prompts are used")
    parser.add_argument("--num-lists", type=int, default=20000, help="lists in the dataset (all splits)")
    parser.add_argument("--length", type=int, default=8, help="cells in a list")
    parser.add_argument("--num-values", type=int, default=16, help="values a cell can hold")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=None, help="default: twice the hidden size")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--minibatch-size", type=int, default=128)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0 = no clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="also append one JSON line per epoch to this file")
    return parser.parse_args()


def build_scenario(args: argparse.Namespace, cache_dir: str) -> DuplicatesScenario:
    config = OmegaConf.structured(
        DuplicatesConfig(
            num_lists=args.num_lists, length=args.length, num_values=args.num_values, cache_dir=cache_dir
        )
    )
    config.default_agent = OmegaConf.merge(
        config.default_agent,
        {
            "hidden_size": args.hidden_size,
            "num_layers": args.num_layers,
            "num_heads": args.num_heads,
            "intermediate_size": args.intermediate_size or 2 * args.hidden_size,
            "max_new_tokens": 3,
        },
    )
    protocol = PROTOCOLS.get(args.protocol)(args.protocol, first_speaker="prover", max_rounds=2)
    return DuplicatesScenario(config, protocol)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as cache_dir:
        scenario = build_scenario(args, cache_dir)
        if args.agent not in scenario.agent_names:
            raise SystemExit(f"--agent must be one of {list(scenario.agent_names)}, got {args.agent!r}")
        train = scenario.demonstrations("train", seed=args.seed)[args.agent].to(args.device)
        val = scenario.demonstrations("val", seed=args.seed)[args.agent].to(args.device)
        policy = scenario.make_agents().policy.policy(args.agent).to(args.device)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = warmup_schedule(optimizer, args.warmup_steps)
    generator = torch.Generator().manual_seed(args.seed)
    setting = {k: v for k, v in vars(args).items() if k not in ("json", "device", "threads")}
    print(f"{args.agent}: {train.batch_size[0]} train, {val.batch_size[0]} val demonstrations; {setting}", flush=True)
    started, steps = time.perf_counter(), 0
    for epoch in range(1, args.epochs + 1):
        policy.train()
        loss, accuracy, epoch_steps = supervised_epoch(
            train, demonstration_loss(policy), optimizer, args.minibatch_size, generator, args.max_grad_norm or None, scheduler
        )
        steps += epoch_steps
        policy.eval()
        val_loss, val_accuracy = held_out_scores(policy, val, 4 * args.minibatch_size)
        row = {
            "epoch": epoch,
            "steps": steps,
            "train_loss": round(loss, 4),
            "train_reproduced": round(accuracy, 4),
            "val_loss": round(val_loss, 4),
            "val_reproduced": round(val_accuracy, 4),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as handle:
                handle.write(json.dumps({**setting, **row}) + "\n")


if __name__ == "__main__":
    main()
