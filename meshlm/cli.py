"""The `meshlm` command: train, check, launch, eval, generate, convert, plan, prepare-data and config show.

Configuration errors, impossible layouts and bad data or checkpoints end with one line on stderr and exit
code 2, before any work starts.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import math
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from meshlm.train import signals

if sys.argv[1:2] == ["train"]:  # `meshlm train`: SIGTERM and SIGINT are caught from here on, before pydantic and torch
    signals.install(for_process=True, deferred=True)
    # A rank killed by a fatal signal (a C++ abort, a segfault in an extension) prints every thread's Python stack
    # to its stderr (torchrun's log) first: where it died, not only "Signal 6 (SIGABRT) received".
    faulthandler.enable(all_threads=True)
elif sys.argv[1:2] == ["launch"]:  # `meshlm launch`: a save signal counts from here on, not only after torch's import
    from meshlm.launch import catch_early

    catch_early()

from meshlm.config import (
    Config,
    ConfigError,
    load_config,
    parse_overrides,
    reference_help,
    reference_markdown,
    to_toml,
)
from meshlm.data.sources import check_source
from meshlm.errors import InputError, RunStopped

if TYPE_CHECKING:
    from meshlm.model import Transformer


def _config_from(args: argparse.Namespace, extra: list[str]) -> Config:
    return load_config(args.config, parse_overrides(extra))


def _run_config(run_dir: Path, overrides: Iterable[tuple[str, Any]] = ()) -> Config:
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ConfigError(f"run directory {run_dir}: config.toml not found (is this a meshlm run directory?)")
    return load_config(path, [("log.run_dir", str(run_dir)), *overrides])


def _resume_point(run_dir: Path) -> str:
    """What a restart resumes from: the newest committed checkpoint (verified when it loads), or none."""
    from meshlm.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    return f"the next start resumes from {found[-1]}" if found else f"{run_dir} has no checkpoint yet"


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from meshlm import launch

    owns_handler = signals.install()  # `meshlm train` installed it on import; an in-process call, here
    launch.worker_started()
    finished = False
    try:
        signals.raise_from_here()
        code, finished = _train(args, extra)
    except BaseException:
        if not signals.stopped_start_up():
            raise
        if os.environ.get("RANK", "0") == "0":  # a stop before the trainer began (config, imports): nothing to save
            print(signals.before_start_line(), flush=True)
        code = 0
    finally:
        signals.finish_run(release=owns_handler)  # the CLI's stays until the process exits: teardown is covered
        signals.ignore_from_here()  # the exit code is decided, also when an error is on its way to its line
    if code == 0:  # finished, saved after a signal, or stopped before its first step: nothing left unsaved
        launch.report_stopped(finished)
        if signals.interrupted():  # Ctrl-C: saved (or nothing to save yet), and the shell's code for an interrupt
            return signals.INTERRUPTED_EXIT
    return code


def _train(args: argparse.Namespace, extra: list[str]) -> tuple[int, bool]:
    """The exit code, and whether the run trained to its last step (a signal then has nothing left to save)."""
    cfg = _config_from(args, extra)  # before torch is imported: a bad config fails in well under a second
    check_source(cfg.data)  # so does a missing data path

    from meshlm.parallel.distributed import env_rank, lost_peer
    from meshlm.train.trainer import train

    try:
        result = train(cfg)
    except RuntimeError as e:  # a peer died mid-collective: one line, and what stays resumable
        if (reason := lost_peer(e)) is None:
            raise
        line = (f"rank {env_rank()} lost a peer ({reason}): stopping without a new checkpoint; "
                f"{_resume_point(Path(cfg.log.run_dir))}")  # fmt: skip
        print(f"meshlm: {line}", file=sys.stderr)
        from meshlm.launch import report_error

        report_error(line)
        return 1, False
    if result.eval_losses and os.environ.get("RANK", "0") == "0":
        print(f"{validation_line(result.eval_losses)}; run directory {result.run_dir}")
    return 0, result.final_step >= cfg.train.steps


def validation_line(eval_losses: list[tuple[int, float]]) -> str:
    """'validation loss 6.2629 (step 0) -> 5.8874 (step 6)'; one evaluation (a resumed run evaluates only at
    its end) is that one, not a change from itself to itself."""
    (first_step, first), (last_step, last) = eval_losses[0], eval_losses[-1]
    if first_step == last_step:
        return f"validation loss {last:.4f} at step {last_step}"
    return f"validation loss {first:.4f} (step {first_step}) -> {last:.4f} (step {last_step})"


def _load_run_model(run_dir: Path, cfg: Config) -> tuple[Transformer, Path]:
    """The newest valid checkpoint's model, which must be the model of the run's config.toml."""
    from meshlm.checkpoint import CheckpointError
    from meshlm.convert import load_checkpoint_model

    model, checkpoint = load_checkpoint_model(run_dir)
    expected = cfg.model.build()
    if model.cfg != expected:
        name = next(k for k, v in expected.to_dict().items() if getattr(model.cfg, k) != v)
        raise CheckpointError(
            f"checkpoint {checkpoint} is for another model (model.{name}: checkpoint "
            f"{getattr(model.cfg, name)!r}, config.toml {getattr(expected, name)!r})"
        )
    model.eval()
    return model, checkpoint


# `meshlm eval` runs the trainer's own evaluation on one process: these override the run's layout.
EVAL_OVERRIDES = [
    ("parallel.layout", ""),
    ("parallel.zero", 0),
    ("parallel.zero_shard_size", None),
    ("parallel.zero_param_dtype", "fp32"),
]


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    """The validation loss the trainer logs, from the newest checkpoint: the trainer's `evaluate` on a
    ParallelModel at world size 1, with the run's batches, dtype and device."""
    import torch
    import torch.distributed as dist

    from meshlm.data import prepare_data
    from meshlm.model.pretrained import init_tokenizer
    from meshlm.parallel.distributed import init_distributed, resolve_autocast, resolve_device
    from meshlm.parallel.engine import parallelize
    from meshlm.parallel.mesh import build_mesh, parse_layout
    from meshlm.train.evaluation import evaluate

    batches = [] if args.batches is None else [("train.eval_batches", args.batches)]
    cfg = _run_config(args.run_dir, [*EVAL_OVERRIDES, *batches])
    model, checkpoint = _load_run_model(args.run_dir, cfg)
    device = resolve_device(cfg.train.device)
    data = prepare_data(cfg.data, model.cfg.vocab_size, init_tokenizer(cfg.model.init_from))
    created_group = init_distributed(device, cfg.parallel.timeout_s)
    try:
        mesh = build_mesh(parse_layout(cfg.parallel.layout, 1), device.type)
        options = {**cfg.parallel.options().model_dump(), "autocast_dtype": resolve_autocast(cfg.train.dtype, device)}
        parallel = parallelize(model.to(device), mesh, options)
        loss = evaluate(parallel, data, cfg, dp_rank=0, dp=1)
    finally:
        if created_group:
            dist.destroy_process_group()
    print(f"{checkpoint}: validation loss {loss:.4f} (perplexity {torch.tensor(loss).exp().item():.2f})")
    return 0


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    """Sample from the newest checkpoint with the run's own tokenizer (the copy in the run directory: a damaged
    one is refused naming it); `--chat` wraps the prompt as a user turn of the run's chat template."""
    import torch

    from meshlm.data.generation import Prompter
    from meshlm.model import generate

    cfg = _run_config(args.run_dir)
    model, checkpoint = _load_run_model(args.run_dir, cfg)
    print(f"meshlm generate: {checkpoint}", file=sys.stderr)
    prompter = Prompter(_run_tokenizer(args.run_dir, cfg, model.cfg.vocab_size), model.cfg.vocab_size)
    prompt = torch.tensor([prompter.encode(args.prompt, chat=args.chat)], dtype=torch.long)
    generator = torch.Generator().manual_seed(args.seed)
    stop = prompter.stop_ids(chat=args.chat)  # what ends an SFT turn / a document
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator, stop)[0].tolist()
    print(prompter.decode(out[prompt.shape[1] :], chat=True) if args.chat else prompter.decode(out))
    return 0


def _run_tokenizer(run_dir: Path, cfg: Config, vocab_size: int) -> Path:
    """The tokenizer.json the run keeps (written at its start); a run directory without one (written before
    runs kept it) gets its data cache's, as its training had it."""
    kept = Path(run_dir) / "tokenizer.json"
    if kept.exists():
        return kept
    from meshlm.data import prepare_data
    from meshlm.model.pretrained import init_tokenizer

    return prepare_data(cfg.data, vocab_size, init_tokenizer(cfg.model.init_from)).directory / "tokenizer.json"


def cmd_check(args: argparse.Namespace, extra: list[str]) -> int:
    """Prove the run exact before it starts: its replica at world 1 and at the mapped layout (docs/check.md)."""
    import json
    import tempfile

    cfg = _config_from(args, extra)
    check_source(cfg.data)
    if args.steps < 2:
        raise ConfigError(f"--steps {args.steps}: the check needs at least 2 (one before and one after the resume)")
    from meshlm.check.run import check_run, print_verdict

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="meshlm-check-"))
    say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():  # stdout: the JSON only
        report, replica = check_run(cfg, steps=args.steps, world=args.world, max_ranks=args.max_ranks,
                                       workdir=workdir, export=args.export, say=say)  # fmt: skip
    if args.json:
        print(json.dumps({**report.as_dict(), "kept": replica.kept, "shrunk": replica.shrunk}, indent=1))
    else:
        print_verdict(report, replica.kept, replica.shrunk)
    return 0 if report.passed else 1


def cmd_prepare_data(args: argparse.Namespace, extra: list[str]) -> int:
    from meshlm.data.prepare import prepare_corpus

    cfg = _config_from(args, extra)
    check_source(cfg.data)  # before the tokenizer's imports
    print(prepare_corpus(cfg, args.workers, args.shard_tokens))
    return 0


def cmd_config_show(args: argparse.Namespace, extra: list[str]) -> int:
    cfg = _config_from(args, extra)
    print(to_toml(cfg), end="")
    if cfg.model.init_from:  # that checkpoint defines the model, not [model]'s preset: say which (as comments)
        print(f"# the model model.init_from {cfg.model.init_from} defines (model.preset is not used):")
        print("".join(f"#   {name} = {value!r}\n" for name, value in cfg.model.build().to_dict().items()), end="")
    print(f"# {model_summary(cfg)}")
    return 0


def model_summary(cfg: Config) -> str:
    """'model: 512-token vocabulary, 3,164,416 parameters' (and the active ones of a mixture of experts): what the
    resolved [model] builds, which the preset's name alone does not say."""
    from meshlm.model.flops import param_counts

    model = cfg.model.build()
    counts = param_counts(model)
    active = f" ({counts['active']:,} active per token)" if model.n_experts else ""
    return f"model: {model.vocab_size:,}-token vocabulary, {counts['total']:,} parameters{active}"


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like every other meshlm error (the usage is behind -h)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def _int_arg(low: int, high: int = 2**63 - 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text!r}")
        return value

    return parse


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 = greedy), got {text!r}")
    return value


def _prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("the prompt must not be empty")
    return text


def cmd_convert(args: argparse.Namespace, _extra: list[str]) -> int:
    from meshlm.convert import run_convert

    return run_convert(args)


def cmd_doctor(args: argparse.Namespace, _extra: list[str]) -> int:
    from meshlm.observe.doctor import run_doctor

    return run_doctor(args)


def add_convert_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `meshlm convert {hf-to-meshlm,meshlm-to-hf}`; `meshlm.convert.run_convert` runs it."""
    parser = subparsers.add_parser(
        "convert", help="convert checkpoints between meshlm and Hugging Face Llama / Qwen2 / Mistral"
    )
    modes = parser.add_subparsers(dest="convert_mode", required=True)
    to_meshlm = modes.add_parser("hf-to-meshlm", help="HF directory -> meshlm safetensors file")
    to_meshlm.add_argument("src", type=Path, metavar="SRC_HF_DIR")
    to_meshlm.add_argument("out", type=Path, metavar="OUT_FILE")
    to_hf = modes.add_parser(
        "meshlm-to-hf", help="meshlm safetensors file, checkpoint folder or run directory -> HF directory"
    )
    to_hf.add_argument("src", type=Path, metavar="SRC")
    to_hf.add_argument("out", type=Path, metavar="OUT_HF_DIR")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    to_hf.add_argument(
        "--max-shard-bytes", type=_int_arg(1), default=None, help="split weights into shards of at most this size"
    )
    to_hf.add_argument(
        "--lora",
        choices=("merged", "peft"),
        default="merged",
        help="a LoRA run: adapters merged into the HF weights, or a PEFT adapter directory (docs/lora.md)",
    )
    return parser


def parse_bytes(text: str) -> int:
    """'4K' -> 4096, '16M' -> 16 MiB, '1G' -> 1 GiB, '512' -> 512 (binary units, as nccl-tests)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4K, 16M, 1G)") from None


def add_doctor_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `doctor` on a subparsers object; `meshlm.observe.doctor.run_doctor` runs it."""
    p = subparsers.add_parser("doctor", help="measure collective bandwidth and matmul speed; flag slow ranks")
    p.add_argument("--layout", default="", help="mesh to measure, e.g. pp=2,dp=2,tp=2 (default: the world as dp)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", type=Path, default=Path("doctor.json"), help="calibration JSON for `meshlm plan`")
    p.add_argument("--min-bytes", type=parse_bytes, default=4096, help="smallest message (default 4K)")
    p.add_argument("--max-bytes", type=parse_bytes, help="largest message (default 16M on CPU, 1G on GPU)")
    p.add_argument("--iters", type=int, default=20, help="most timed calls per size")
    p.add_argument("--budget-s", type=float, default=0.5, help="time to spend per size and op, roughly")
    p.add_argument("--matmul-size", type=int, help="n of the n×n matmul (default 512 CPU, 8192 GPU)")
    p.add_argument("--outlier", type=float, default=0.8, help="flag below this fraction of the median")
    p.add_argument("--slow-rank", type=int, help="testing: make this rank's matmul slower (or $MESHLM_SLOW_RANK)")
    p.add_argument("--slow-factor", type=float, default=3.0, help="testing: how much slower")
    p.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    return p


def add_check_parser(sub: argparse._SubParsersAction, with_fields: dict) -> None:
    p = _with_fields(
        sub.add_parser(
            "check",
            help="prove a run exact before it starts: a shrunken CPU replica of its model, plan, data and layout "
            "against one process (takes what train takes)",
            **with_fields,
        )
    )
    p.add_argument("--config", help="TOML config file (defaults apply to everything it omits)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps of each run (default 5)")
    p.add_argument("--world", type=int, help="the run's GPU count (needed for parallel.layout auto)")
    p.add_argument("--max-ranks", type=int, default=8, help="CPU ranks the replica may use (default 8)")
    p.add_argument("--json", action="store_true", help="the verdict as JSON (for CI)")
    p.add_argument("--workdir", help="where the replica's runs go (default: a fresh temporary directory)")
    p.add_argument(
        "--export",
        action="store_true",
        help="also export the layout run as `meshlm convert meshlm-to-hf` does (merged; a LoRA run on an HF base "
        "also as PEFT adapters), load it with transformers and compare its logits (needs transformers, peft)",
    )
    p.set_defaults(func=cmd_check)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a run's newest checkpoint")
    p.add_argument("run_dir", type=Path, help="a meshlm run directory (log.run_dir of the run)")
    p.add_argument("--prompt", type=_prompt, default="def ", help="text to continue (default: %(default)r)")
    p.add_argument(
        "--max-new-tokens", type=_int_arg(0), default=100, help="most tokens to add; generation also stops at the "
        "tokenizer's end-of-text / end-of-turn token (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--temperature", type=_temperature, default=0.8, help="sampling temperature; 0 = greedy (default: %(default)s)"
    )
    p.add_argument("--top-k", type=_int_arg(1), default=50, help="sample among the k likeliest tokens (default: 50)")
    p.add_argument("--seed", type=_int_arg(0), default=0, help="random seed of the sampling (default: 0)")
    p.add_argument(
        "--chat", action="store_true", help="the prompt is a user turn of the run's chat template (a fine-tuned chat "
        "model; meshlm's plain template without one), and the reply is printed, ended at the end-of-turn token",
    )  # fmt: skip
    p.set_defaults(func=cmd_generate)


# The fields `train --help` lists (the rest: --help-all): what a first run and a first parallel run set.
COMMON_FIELDS = (
    "model.preset", "model.init_from", "data.source", "data.format", "data.seq_len", "train.steps",
    "train.global_batch", "train.micro_batch", "train.lr", "parallel.layout", "parallel.zero", "lora.rank",
    "checkpoint.every", "log.run_dir",
)  # fmt: skip


def common_help() -> str:
    """The epilog of `train --help` (and check, prepare-data, config show): the common fields, and where the
    rest are."""
    lines = reference_help().splitlines()
    common = [line for line in lines if line.strip().split(" ", 1)[0].removeprefix("--") in COMMON_FIELDS]
    return "\n".join([
        "common config fields (--section.field VALUE; the defaults apply to everything not set):", *common,
        "every field: --help-all (or `meshlm config reference`); a TOML file of them: --config",
    ])  # fmt: skip


class HelpAll(argparse.Action):
    """`--help-all`: the help with every config field, its default and meaning."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="list every config field")

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        parser.epilog = reference_help()
        parser.print_help()
        parser.exit()


def _with_fields(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--help-all", action=HelpAll)
    return parser


def build_parser() -> argparse.ArgumentParser:
    version = sys.modules["meshlm"].__version__  # the package (above this module's layer), imported before it
    parser = Parser(prog="meshlm", description="Train Llama-style models on a device mesh.")
    parser.add_argument("--version", action="version", version=f"meshlm {version}")
    sub = parser.add_subparsers(dest="command", required=True)

    with_fields = {"epilog": common_help(), "formatter_class": argparse.RawDescriptionHelpFormatter}
    p = _with_fields(
        sub.add_parser("train", help="train (or resume) a run; any config field: --section.field VALUE", **with_fields)
    )
    p.add_argument("--config", help="TOML config file (defaults apply to everything it omits)")
    p.set_defaults(func=cmd_train)

    add_check_parser(sub, with_fields)

    p = sub.add_parser(
        "launch",
        help="torchrun with torchrun's own arguments, e.g. `meshlm launch --nproc-per-node 4 -m meshlm.cli train "
        "--config run.toml`; exits 0 after a clean preemption and says a failure in one line",
    )
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="exactly what torchrun takes")

    p = sub.add_parser("eval", help="validation loss of a run's newest checkpoint")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--batches", type=int, help="validation batches (default: the run's train.eval_batches)")
    p.set_defaults(func=cmd_eval)

    add_generate_parser(sub)

    from meshlm.data.shards import SHARD_TOKENS

    p = _with_fields(
        sub.add_parser(
            "prepare-data",
            help="tokenize the corpus of a config into token shards with many processes, before training",
            **with_fields,
        )
    )
    p.add_argument("--config", help="TOML config file (the [data] and [model] sections matter; overrides too)")
    p.add_argument("--workers", type=_int_arg(1, 4096), default=os.cpu_count() or 1, help="tokenizer processes")
    p.add_argument("--shard-tokens", type=_int_arg(1), default=SHARD_TOKENS, help="tokens per shard file")
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser("config", help="configuration tools")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    show = _with_fields(config_sub.add_parser("show", help="print the resolved config as TOML", **with_fields))
    show.add_argument("--config", help="TOML config file")
    show.set_defaults(func=cmd_config_show)
    reference = config_sub.add_parser("reference", help="print the table of every config field (as in the README)")
    reference.set_defaults(func=lambda _args, _extra: print(reference_markdown()) or 0)

    add_convert_parser(sub)
    sub.choices["convert"].set_defaults(func=cmd_convert)
    add_doctor_parser(sub)
    sub.choices["doctor"].set_defaults(func=cmd_doctor)

    from meshlm.observe.report import add_report_parser, run_report
    from meshlm.plan.cli import add_plan_parser, run_plan

    add_report_parser(sub)
    sub.choices["report"].set_defaults(func=lambda a, _extra: run_report(a))

    add_plan_parser(sub)
    sub.choices["plan"].set_defaults(func=lambda a, _extra: run_plan(a))
    from meshlm.train.lighthouse import add_lighthouse_parser, run_lighthouse

    add_lighthouse_parser(sub)
    sub.choices["lighthouse"].set_defaults(func=lambda a, _extra: run_lighthouse(a))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):  # torchrun's own arguments, verbatim
        from meshlm.launch import main as launch

        try:
            return launch(argv[1:])
        except KeyboardInterrupt:  # Ctrl-C while torch is imported, before the launcher's handler: no worker yet
            print("meshlm launch: SIGINT before any worker started: nothing to save", file=sys.stderr)
            return signals.INTERRUPTED_EXIT
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.func not in (cmd_train, cmd_check, cmd_config_show, cmd_prepare_data):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args, extra)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:  # `meshlm config reference | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush has nowhere to fail
        return 0
    except InputError as e:  # a config field, layout, data, checkpoint or plan request: one line
        # every rank of a job meets the same one (each checks the same config, rank 0's verdicts are broadcast):
        # rank 0 says it; a rank whose error is its own says it too
        if os.environ.get("RANK", "0") == "0" or e.rank_local:
            print(f"meshlm: {e}", file=sys.stderr)
        from meshlm.launch import report_error

        report_error(str(e))
        return 2
    except RunStopped as e:  # a guard stopped the run (diverged, desynced): one line, the newest checkpoint kept
        if os.environ.get("RANK", "0") == "0":
            print(f"meshlm: {e}", file=sys.stderr)
        from meshlm.launch import report_error

        report_error(str(e))
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a training loop, or a second one inside it: stop at once
        if os.environ.get("RANK", "0") == "0":
            print("meshlm: interrupted (SIGINT): stopped at once, nothing more saved", file=sys.stderr)
        return signals.INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
