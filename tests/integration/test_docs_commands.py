"""Every `meshlm ...`, `python -m meshlm.cli ...` and `torchrun ... -m meshlm.cli ...` command shown in README.md
and docs/*.md (code blocks) parses against the CLI's own parser, and every `--section.field` it passes to the
trainer is a config field with a valid value, so a removed or renamed field fails here. The cheap ones (`plan`,
`config show`) run for real, and a launch file docs/clusters.md shows is the one its command writes today."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.check.shrink import map_layout
from meshlm.cli import build_parser, cmd_check, cmd_config_show, cmd_prepare_data, cmd_train
from meshlm.cli import main as cli_main
from meshlm.config import ConfigError, load_config, parse_overrides
from meshlm.parallel.mesh import Layout
from meshlm.plan.cli import run_plan
from meshlm.plan.emit import GRACE_MARGIN, grace_for

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.M | re.S)
CHEAP = {"plan", "config"}  # run for real: no training, no processes


def shown_commands() -> list[tuple[str, list[str]]]:
    """(page:line, the meshlm argv) of every command in a bash/sh or untagged code block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            if block[1] not in ("", "bash", "sh", "shell"):
                continue
            first = text[: block.start(2)].count("\n") + 1
            joined = block[2].replace("\\\n", " ")
            for offset, line in enumerate(joined.splitlines()):
                argv = meshlm_argv(line)
                if argv is not None:
                    found.append((f"{page.relative_to(ROOT)}:{first + offset}", argv))
    return found


def meshlm_argv(line: str) -> list[str] | None:
    """The arguments meshlm's CLI gets from one shell line, or None if it runs no meshlm command."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    ends = [i for i, w in enumerate(words) if w in ("&", "&&", "||", "|", ";", ">", ">>")]
    words = words[: ends[0]] if ends else words  # the command, not what the shell does after it
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words or words[0].endswith(":"):
        return None
    if words[0] == "sbatch" and len(words) > 1:  # arguments after the script go to `meshlm train`
        return ["train", *words[2:]]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "meshlm.cli":
            return words[i + 2 :]
    if Path(words[0]).name == "meshlm" and len(words) > 1 and not words[1].endswith(":"):
        return words[1:]
    return None


COMMANDS = shown_commands()


def test_the_docs_show_commands() -> None:
    """The extraction works: the README's quick start and planner commands are among them."""
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"README.md", "docs/planner.md", "docs/clusters.md", "docs/observability.md"} <= pages
    assert len(COMMANDS) > 30


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_command_in_the_docs_parses(where: str, argv: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    # Elisions and "$@" go; another shell variable stands for one value (e.g. --prompt "$PROMPT").
    argv = ["x" if a.startswith("$") else a for a in argv if a not in ("...", "$@", "$*")]
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `meshlm {shlex.join(argv)}` does not parse: {capsys.readouterr().err.strip()}")
    if argv[0] == "launch":  # `meshlm launch ... SCRIPT.py`: torchrun's arguments, then the script's own
        assert Path(ROOT / next(a for a in argv if a.endswith(".py"))).is_file(), where
        return
    check_overrides(where, args, extra)
    if argv[0] not in CHEAP:
        return
    if argv[0] == "config":
        assert cli_main(["config", "show", *[str(ROOT / a) if (ROOT / a).is_file() else a for a in argv[2:]]]) == 0
        return
    if args.emit:  # a launch file needs the corpus: --data-source, or a meshlm config that names one
        assert args.data_source or str(args.model).endswith(".toml"), f"{where}: --emit without --data-source"
    if any(not (ROOT / p).exists() for p in _paths(args)):
        return  # needs a file the docs' reader has (a doctor.json, a downloaded config): parsed only
    if args.emit:
        args.emit_to = tmp_path / "launch"
        args.image, args.bucket = args.image or "registry/meshlm:1", args.bucket or "s3://b/runs"
    if args.model and (ROOT / args.model).exists():
        args.model = str(ROOT / args.model)
    assert run_plan(args) == 0, f"{where}: {capsys.readouterr().err}"
    if args.emit and where.startswith("docs/clusters.md:"):
        check_shown_launch_file(CLUSTERS.read_text(), args, args.emit_to.read_text())


CLUSTERS = ROOT / "docs" / "clusters.md"


def check_shown_launch_file(doc: str, args: object, written: str) -> None:
    """docs/clusters.md shows what its commands write: the sbatch script and the SkyPilot task byte for byte,
    the `--check` line (abridged at `...`) and the check's layout mapping, and the grace it explains."""
    blocks = {b[2].split("\n")[0]: b[2] for b in FENCE.finditer(doc)}
    if args.emit == "slurm" and args.check:
        shown = next(b for b in blocks.values() if b.startswith("meshlm_check --world")).strip()
        line = next(x for x in written.splitlines() if x.startswith("meshlm_check --world"))
        pieces = shown.split(" ... ")
        assert len(pieces) == 2 and line.startswith(pieces[0]) and line.endswith(pieces[1]), (shown, line)
        layout = re.search(r"--parallel\.layout (\S+)", line)[1]
        sizes = {dim: int(n) for dim, n in re.findall(r"(\w+)=(\d+)", layout)}
        mapping = f"`layout {layout} -> {map_layout(Layout(**sizes))}`"
        assert mapping in doc, f"docs/clusters.md should say the check maps {mapping}"
        return
    if args.emit.startswith("kubernetes"):
        return  # the PyTorchJob and the indexed Job are described, not shown
    first = written.splitlines()[0]  # "#!/bin/bash"; the task's "# MODEL on N× GPU: LAYOUT, POOL"
    shown = blocks.get(first)
    assert shown == written, f"docs/clusters.md shows another {args.emit} file than its command writes ({first})"
    if args.emit == "slurm":
        check_grace_prose(doc, written)


def check_grace_prose(doc: str, written: str) -> None:
    """The prose's grace is the script's, and its step and checkpoint seconds give it (`grace_for`), up to their
    rounding to whole seconds: GRACE_MARGIN x half a second per step and for the checkpoint, and the ceiling."""
    grace = int(re.search(r"--fault\.grace_s (\d+)", written)[1])
    every = int(re.search(r"--log\.every (\d+)", written)[1])
    said = re.search(r"above gets (\d+) s \(`log\.every (\d+)`: one step is (\d+) s; .*? takes (\d+) s", doc)
    assert said is not None and (int(said[1]), int(said[2])) == (grace, every), said and said.groups()
    step_s, checkpoint_s = int(said[3]), int(said[4])
    assert abs(grace_for(every * step_s, checkpoint_s) - grace) <= GRACE_MARGIN * 0.5 * (every + 1) + 1, said.groups()


def check_overrides(where: str, args: object, extra: list[str]) -> None:
    """Trainer arguments are config fields with valid values (ConfigError otherwise); others take none."""
    takes_overrides = args.func in (cmd_train, cmd_check, cmd_config_show, cmd_prepare_data)
    assert takes_overrides or not extra, f"{where}: unknown arguments {extra}"
    if takes_overrides:
        config = getattr(args, "config", None)
        config = ROOT / config if config is not None and (ROOT / config).is_file() else None
        pairs = parse_overrides(extra)
        if any(k == "model.init_from" and not Path(str(v)).exists() for k, v in pairs):
            # the reader's own checkpoint: a long-context preset stands in for its model
            pairs = [("model.preset", "llama3-8b"), *((k, v) for k, v in pairs if k != "model.init_from")]
        load_config(config, pairs)  # unknown fields and bad values raise ConfigError


def test_a_removed_field_in_a_shown_command_fails() -> None:
    """Mutation check: the line docs/clusters.md used to show, with the removed
    `--train.activation_checkpointing`, is caught; the same line with `--train.recompute` passes."""
    line = ("srun meshlm launch --nnodes=4:8 -m meshlm.cli train --model.preset llama3-70b "
            '--train.activation_checkpointing false --log.run_dir /shared/run "$@" &')  # fmt: skip
    for old, ok in (("--train.activation_checkpointing false", False), ("--train.recompute none", True)):
        argv = [a for a in meshlm_argv(line.replace("--train.activation_checkpointing false", old)) if a[0] != "$"]
        args, extra = build_parser().parse_known_args(argv)
        if ok:
            check_overrides("line", args, extra)
        else:
            with pytest.raises(ConfigError, match=re.escape("train.activation_checkpointing: unknown field")):
                check_overrides("line", args, extra)


def _paths(args: object) -> list[str]:
    """The files a plan command reads (calibration, a model path)."""
    paths = [str(args.calibration)] if getattr(args, "calibration", None) else []
    model = getattr(args, "model", "") or ""
    if "/" in model or model.endswith((".toml", ".json")):
        paths.append(model)
    return paths


# ---- the README's commands on the demo's model ----------------------------------------------------------------
README = ROOT / "README.md"
TRAINS = {"train", "check", "prepare-data"}  # the commands that read [model] and [data]


def readme_lines() -> list[str]:
    """The shell lines of the README's bash blocks, continuations joined, `make demo` as the Makefile runs it."""
    demo = re.search(r"^demo:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M)[1].replace("$(VENV)", ".venv")
    lines = []
    for block in FENCE.finditer(README.read_text()):
        if block[1] == "bash":
            for line in block[2].replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                lines += [demo] if line == "make demo" else [] if line in ("", "make test") else [line]
    return lines


def test_the_readme_trains_one_model_on_one_token_cache() -> None:
    """Every README command that trains, checks or tokenizes builds the demo's model (configs/tiny.toml, which
    `make demo` runs) on the demo's token cache, so the tokenizer is trained once; every command a reader copies
    launches with `meshlm launch`, never a bare torchrun. Mutation: the README before issue 49 (its parallel
    runs without the config, or with one of a 2,048-token vocabulary) fails here."""
    from meshlm.data.dataset import cache_key

    demo = load_config(ROOT / "configs" / "tiny.toml")
    want = (demo.model.build(), cache_key(demo.data, demo.model.build().vocab_size))
    lines = readme_lines()
    assert not [line for line in lines if re.match(r"(\S*/)?torchrun\b", line)]
    training = [argv for argv in map(meshlm_argv, lines) if argv and argv[0] in TRAINS]
    assert len(training) >= 6, training
    for argv in training:
        args, extra = build_parser().parse_known_args(argv)
        cfg = load_config(ROOT / args.config if args.config else None, parse_overrides(extra))
        assert (cfg.model.build(), cache_key(cfg.data, cfg.model.build().vocab_size)) == want, argv


def _shrunk(words: list[str], max_chars: int) -> list[str]:
    """A README command made short (a few steps, `max_chars` of the corpus), the model and the data's every
    other field as given; `.venv/bin/X` is this interpreter's."""
    bin_dir = Path(sys.executable).parent
    words = [str(bin_dir / w.removeprefix(".venv/bin/")) if w.startswith(".venv/bin/") else w for w in words]
    if Path(words[0]).name == "meshlm":  # the package under test, whichever checkout the script was installed from
        words = [sys.executable, "-m", "meshlm.cli", *words[1:]]
    argv = meshlm_argv(shlex.join(words)) or []
    if argv[:1] == ["launch"]:  # what torchrun's agent runs
        argv = meshlm_argv(shlex.join(argv[1:])) or []
    if words[-1].endswith(".py") or any(w.endswith(".py") for w in words):  # an example of the library API
        return [*words, "--max-chars", str(max_chars), "--steps", "2"]
    command = argv[0] if argv else ""
    if command in TRAINS:
        words += ["--data.max_chars", str(max_chars)]
    if command == "train":
        words += ["--train.steps", "4", "--train.eval_every", "2", "--train.eval_batches", "2",
                  "--checkpoint.every", "2", "--log.progress", "false"]  # fmt: skip
    if command == "check":
        words += ["--steps", "2"]
    if command == "doctor":
        words += ["--max-bytes", "64K", "--budget-s", "0.05", "--iters", "3"]
    return words


@pytest.mark.slow  # every README command for real (1 to 8 ranks, the check, doctor): 11.5 min at load average 14
def test_every_readme_command_runs_and_the_tokenizer_is_trained_once(tmp_path: Path) -> None:
    """In a fresh directory (configs and examples as in a clone, no token cache), the README's commands in
    order, each shortened: all succeed, the 512-token tokenizer is trained by the first (`make demo`) and only
    there, and every run the README starts keeps that one tokenizer. `config show` and a `plan` that reads no
    doctor file are the fast tier's (the same lines, run in its process), not run again here."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    said = []
    for line in readme_lines():
        argv = meshlm_argv(line) or []
        if argv[:1] == ["config"] or (argv[:1] == ["plan"] and "--calibration" not in argv):
            continue  # reads no run and no token cache: run as written by test_every_command_in_the_docs_parses
        words = shlex.split(line)
        extra_env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
        words = _shrunk(words[len(extra_env) :], max_chars=1_500_000)  # ~90 documents: 2 % is one
        # 600 s: an eight-rank run on a loaded 2-core machine takes a few minutes; a hang ends far later
        done = subprocess.run(words, cwd=tmp_path, env={**env, **extra_env}, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        said.append(done.stdout + done.stderr)
        if len(said) == 1:
            (tokenizer,) = (tmp_path / ".cache" / "meshlm").glob("*/tokenizer.json")
            written = tokenizer.stat().st_mtime_ns
    trained = [output for output in said if "training a 512-token BPE tokenizer" in output]
    assert len(trained) == 1 and trained[0] is said[0], [s[:300] for s in trained]
    assert tokenizer.stat().st_mtime_ns == written
    runs = sorted((tmp_path / "runs").glob("*/tokenizer.json"))
    assert len(runs) >= 5 and all(run.read_bytes() == tokenizer.read_bytes() for run in runs), runs
