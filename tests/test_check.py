"""`meshlm.check`: correct layouts (tp=2 SP, pp=2 interleaved, LoRA at dp=2,tp=2 ZeRO-1) pass against one
process; the suite's mutations (a wrong plan entry, a missing gradient sum over tp, a tied weight counted twice
in the norm) fail and are localised to the module responsible; a half-tied plan is refused naming both modules.

Each check starts torchrun several times (world 1, the layout, the resume; on a failure the step-1 gradient
runs), ~10-20 s each on a loaded 2-core machine, so these tests are slow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
from conftest import small_run_args
from equivalence import tp_input_gradient_not_all_reduced
from test_tied import TIED, tied_weight_counted_twice_in_the_norm

import meshlm
from meshlm.check.run import CheckError
from meshlm.cli import main
from meshlm.model import Transformer, preset
from meshlm.parallel.plans import LLAMA
from meshlm.testing import global_batch

MODEL = preset("test")
# A wrong plan entry: the blocks' second norm is left out of the tp table under sequence parallel. The losses
# stay within 1e-5 over five steps (3e-7); the final weights do not (1e-3 rel).
WRONG_PLAN = dataclasses.replace(
    LLAMA,
    tensor_parallel={k: v for k, v in LLAMA.tensor_parallel.items() if not k.endswith("post_attention_layernorm")},
)


# A half-tied plan: the tied model's head split vocab-parallel, its embedding left whole.
HALF_TIED = dataclasses.replace(
    LLAMA, tensor_parallel={k: v for k, v in LLAMA.tensor_parallel.items() if k != "model.embed_tokens"}
)


def make_model() -> Transformer:
    return Transformer(MODEL)


def make_tied() -> Transformer:
    return Transformer(TIED)


# The suite's code mutations, injected by the model factory: it runs on every rank of every check run before
# anything is parallelised, and the bug stays for the rank's lifetime (at world 1 it has nothing to act on).
_BUGS = contextlib.ExitStack()


def tp_input_gradient_not_summed() -> Transformer:
    _BUGS.enter_context(tp_input_gradient_not_all_reduced())
    return Transformer(MODEL)


def tied_counted_twice_in_the_norm() -> Transformer:
    _BUGS.enter_context(tied_weight_counted_twice_in_the_norm())
    return Transformer(TIED)


def batches() -> list:
    return [global_batch(step, 8, 32, MODEL.vocab_size) for step in range(5)]


PASSING = {
    "tp=2 sp": ("tp=2", {"sequence_parallel": True}),
    "pp=2 interleaved x2": ("pp=2", {"schedule": "interleaved", "virtual_stages": 2, "micro_batch": 2}),
    # ZeRO-3 holds only the shards between steps: the check reads a rank's own copies of the weights only
    # where they are in memory (it read freed storage, and the ranks died of SIGSEGV)
    "dp=2 zero3": ("dp=2", {"zero": 3}),
}


@pytest.mark.slow  # three torchrun starts (the layout, world 1, the resume): 17-37 s on 2 shared cores
@pytest.mark.parametrize("case", PASSING)
def test_correct_plan_passes(case: str, tmp_path) -> None:
    layout, parallel = PASSING[case]
    report = meshlm.check(make_model, batches(), layout, plan=LLAMA, workdir=tmp_path, **parallel)
    assert report.passed, report.to_json()
    assert [r.passed for r in report.rows] == [True, True]


# (model factory, plan, layout, [parallel]; the module the localisation must name, its placement, the
# dimension whose removal makes it exact)
MUTATIONS = {
    # the blocks' second norm not summed over tp: its step-1 gradient alone differs
    "wrong plan entry": (
        make_model, WRONG_PLAN, "tp=2", {"sequence_parallel": True},
        "model.layers.0.post_attention_layernorm: grad differs", "replicated over tp", "tp=1",
    ),
    # Megatron's f without its backward all-reduce: backward meets it first at lm_head's input, so every
    # gradient before lm_head differs and lm_head's own agrees
    "missing gradient sum over tp": (
        tp_input_gradient_not_summed, LLAMA, "tp=2", {},
        "lm_head: its input gradient differs", "sharded tp dim 0", "tp=1",
    ),
    # the tied weight's copy on the last stage counted in the global norm too: gradients agree, the norm not
    "tied weight counted twice in the norm": (
        tied_counted_twice_in_the_norm, LLAMA, "pp=2", {"micro_batch": 2},
        "model.embed_tokens: gradients agree, their global norm differs", "tied over the first and last", "pp=1",
    ),
}  # fmt: skip


@pytest.mark.slow  # per mutation 5 torchrun starts (no resume after a failure): 29-65 s each on 2 shared cores
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutations_fail_and_are_localised(mutation: str, tmp_path) -> None:
    factory, plan, layout, parallel, culprit, placement, exact = MUTATIONS[mutation]
    report = meshlm.check(factory, batches(), layout, plan=plan, workdir=tmp_path, **parallel)
    out = json.loads(json.dumps(report.to_json()))  # what `meshlm check --json` prints, less kept/shrunk
    assert set(out) == {"layout", "passed", "checks", "phases_s", "culprit"} and out["layout"] == layout
    assert not out["passed"] and not out["checks"][0]["passed"], out
    assert [c["check"] for c in out["checks"]] == [f"5 steps at {layout} vs world 1", "step-1 gradients per tensor"]
    assert out["culprit"].startswith(culprit), out["culprit"]
    assert placement in out["culprit"] and f"exact with {exact}" in out["culprit"], out["culprit"]


@pytest.mark.slow  # one torchrun start, refused: 5-14 s on 2 shared cores
def test_a_half_tied_plan_is_refused_naming_both_modules_before_the_reference(tmp_path) -> None:
    with pytest.raises(CheckError) as e:
        meshlm.check(make_tied, batches(), "tp=2", plan=HALF_TIED, workdir=tmp_path)
    line = str(e.value)
    assert "\n" not in line and "model.embed_tokens (not in tensor_parallel) and lm_head (vocab_head)" in line, line
    assert not (tmp_path / "reference").exists()  # the layout runs first: refused before any other work


def test_ids_fold_into_the_replica_vocabulary_keeping_ignored_labels() -> None:
    import torch

    from meshlm.check.run import map_ids

    x = torch.tensor([[5, 130, 257]])
    y = torch.tensor([[130, -100, 300]])
    [(mx, my)] = map_ids([(x, y)], 128, -100)
    assert mx.tolist() == [[5, 2, 1]] and my.tolist() == [[2, -100, 44]]


def test_too_few_steps_is_one_line(capsys) -> None:
    assert main(["check", "--steps", "1", "--model.preset", "test", "--data.seq_len", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--steps 1" in err, err


# `meshlm check --json` on a run's config: (overrides, a suite mutation injected into every Python process the
# check starts or None, exit code, how the culprit starts)
CLI = {
    # Megatron's f without its backward all-reduce: named at lm_head, as through meshlm.check
    "missing gradient sum over tp": (["--parallel.layout", "tp=2"], "tp_input_gradient_not_all_reduced", 1, "lm_head"),
    # LoRA adapters over a frozen base at tp=2 with ZeRO-1: passes
    "lora tp=2": (["--parallel.layout", "dp=2,tp=2", "--parallel.zero", "1", "--lora.rank", "4"], None, 0, ""),
}


@pytest.mark.slow  # corpus tokenized (shared with other tests), then 3-5 torchrun starts: 26-70 s on 2 shared cores
@pytest.mark.parametrize("case", CLI)
def test_the_cli_json_and_exit_code(case: str, data_cache, tmp_path, monkeypatch, capsys) -> None:
    """The mutation is injected by a sitecustomize on the ranks' path (the check passes them the caller's): the
    run's own config, the user's command, with a bug in meshlm's code."""
    overrides, mutation, code, culprit = CLI[case]
    if mutation:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(
            f"from equivalence import {mutation}\n\n"
            f"BUG = {mutation}()  # held: a collected one would undo the patch\n"
            "BUG.__enter__()\n"
        )
        monkeypatch.syspath_prepend(str(site))
    run = small_run_args(data_cache, tmp_path / "run")
    assert main(["check", "--json", "--workdir", str(tmp_path / "check"), *overrides, *run]) == code
    out = json.loads(capsys.readouterr().out)  # stdout is the JSON alone (the tokenizer's lines go to stderr)
    assert set(out) == {"layout", "passed", "checks", "phases_s", "culprit", "kept", "shrunk"}, out
    assert out["passed"] == (code == 0) and out["checks"][0]["passed"] == (code == 0), out
    assert list(out["phases_s"])[:2] == ["shrink", "data"], out["phases_s"]
    if code:
        assert out["culprit"].startswith(f"{culprit}: its input gradient differs"), out["culprit"]
        assert "sharded tp dim 0" in out["culprit"] and "exact with tp=1" in out["culprit"], out["culprit"]
    else:
        assert [c["passed"] for c in out["checks"]] == [True, True] and not out["culprit"], out
        assert any("LoRA" in line or "lora" in line for line in out["kept"]), out["kept"]
