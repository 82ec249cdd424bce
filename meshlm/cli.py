"""The `meshlm` command: train, eval, generate, convert, plan and config show.

Configuration errors, impossible layouts and bad data or checkpoints end with one line on stderr and exit
code 2, before any work starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshlm.config import Config, ConfigError, load_config, parse_overrides, reference_markdown, to_toml

if TYPE_CHECKING:
    from meshlm.model import Transformer


def _config_from(args: argparse.Namespace, extra: list[str]) -> Config:
    return load_config(args.config, parse_overrides(extra))


def _run_config(run_dir: Path) -> Config:
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ConfigError(f"run directory {run_dir}: config.toml not found (is this a meshlm run directory?)")
    return load_config(path, [("log.run_dir", str(run_dir))])


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from meshlm.train.trainer import train

    cfg = _config_from(args, extra)
    result = train(cfg)
    if result.eval_losses and os.environ.get("RANK", "0") == "0":
        first, last = result.eval_losses[0][1], result.eval_losses[-1][1]
        print(f"validation loss {first:.4f} -> {last:.4f}; run directory {result.run_dir}")
    return 0


def _load_run_model(run_dir: Path, cfg: Config) -> tuple[Transformer, Path]:
    import torch

    from meshlm.checkpoint import CheckpointError, latest_valid_checkpoint, load_model_state
    from meshlm.model import Transformer

    checkpoint = latest_valid_checkpoint(run_dir, warn=lambda m: print(m, file=sys.stderr))
    if checkpoint is None:
        raise CheckpointError(f"run directory {run_dir}: no valid checkpoint under {run_dir}/checkpoints")
    model = Transformer(cfg.model.build())
    model.load_state_dict(load_model_state(checkpoint))
    model.eval()
    torch.set_grad_enabled(False)
    return model, checkpoint


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from meshlm.data import eval_batches, prepare_data
    from meshlm.model import cross_entropy_loss

    cfg = _run_config(args.run_dir)
    model, checkpoint = _load_run_model(args.run_dir, cfg)
    data = prepare_data(cfg.data, cfg.model.build().vocab_size)
    with torch.no_grad():
        losses = [
            cross_entropy_loss(model(x), y).item()
            for x, y in eval_batches(data.val, cfg.data.seq_len, cfg.train.global_batch, args.batches)
        ]
    loss = sum(losses) / len(losses)
    print(f"{checkpoint}: validation loss {loss:.4f} (perplexity {torch.tensor(loss).exp().item():.2f})")
    return 0


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from meshlm.data import decode, encode, prepare_data
    from meshlm.model import generate

    cfg = _run_config(args.run_dir)
    model, _ = _load_run_model(args.run_dir, cfg)
    tokenizer = prepare_data(cfg.data, cfg.model.build().vocab_size).tokenizer
    prompt = torch.tensor([encode(tokenizer, args.prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(args.seed)
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator)
    print(decode(tokenizer, out[0].tolist()))
    return 0


def cmd_config_show(args: argparse.Namespace, extra: list[str]) -> int:
    print(to_toml(_config_from(args, extra)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description="Train Llama-style models on a device mesh.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train (or resume) a run; any config field: --section.field VALUE")
    p.add_argument("--config", help="TOML config file (defaults apply to everything it omits)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="validation loss of a run's newest checkpoint")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--batches", type=int, default=8)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="sample text from a run's newest checkpoint")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("config", help="configuration tools")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config as TOML")
    show.add_argument("--config", help="TOML config file")
    show.set_defaults(func=cmd_config_show)
    reference = config_sub.add_parser("reference", help="print the table of every config field (as in the README)")
    reference.set_defaults(func=lambda _args, _extra: print(reference_markdown()) or 0)

    from meshlm.model.hf import add_convert_parser, run_convert

    add_convert_parser(sub)
    sub.choices["convert"].set_defaults(func=lambda a, _extra: run_convert(a))

    from meshlm.observe.doctor import add_doctor_parser, run_doctor
    from meshlm.observe.report import add_report_parser, run_report
    from meshlm.plan.cli import add_plan_parser, run_plan

    add_doctor_parser(sub)
    sub.choices["doctor"].set_defaults(func=lambda a, _extra: run_doctor(a))
    add_report_parser(sub)
    sub.choices["report"].set_defaults(func=lambda a, _extra: run_report(a))

    add_plan_parser(sub)
    sub.choices["plan"].set_defaults(func=lambda a, _extra: run_plan(a))
    return parser


def main(argv: list[str] | None = None) -> int:
    from meshlm.checkpoint import CheckpointError
    from meshlm.data import DataError
    from meshlm.parallel.mesh import LayoutError
    from meshlm.plan import PlanError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.func not in (cmd_train, cmd_config_show):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra)
    except (ConfigError, LayoutError, DataError, CheckpointError, PlanError) as e:
        print(f"meshlm: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
