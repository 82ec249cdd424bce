"""Tied embedding and head everywhere: pipeline parallel (both ends hold the weight, gradients summed over the
embedding group), tensor parallel (one vocab-parallel shard), checkpoints (saved once, resumed at another pp),
and every command that reads a run (eval, generate, convert both ways, transformers loading the export).

Equivalence as tests/equivalence.py says: AdamW runs by their loss curve, SGD runs also by their final weights;
the mutation that drops the embedding-group all-reduce must fail the check."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from distributed import run_shared
from equivalence import (
    TEST_MODEL,
    _patched,
    assert_close_runs,
    assert_identical_weights,
    criterion_failures,
    reference,
    tail,
    train_layout,
)

from meshlm.cli import main
from meshlm.model import Transformer
from meshlm.parallel.parallel_plan import ParallelPlan, PipelineSplit, PlanError
from meshlm.parallel.placement import Placements
from meshlm.parallel.plan_registry import plan_for
from meshlm.parallel.pp.pipeline import TiedStages, split_model
from meshlm.parallel.tp.rules import check_tp_plan

TIED = TEST_MODEL.replace(tie_embeddings=True)
OPTIMIZERS = ("adamw", "sgd")
MUTATED_STEPS = 3  # a wrong gradient shows in the loss after one update; the norm at once
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _train_both(layout: str, par: dict, micro_batch: int) -> dict[str, dict]:
    return {
        opt: train_layout(layout, par, micro_batch=micro_batch, model_cfg=TIED, seq_len=16, optimizer=opt)
        for opt in OPTIMIZERS
    }


def _runs(runs: list) -> list[dict]:
    return [_train_both(*run) for run in runs]


def _assert_matches_reference(got: dict[str, dict], label: object) -> None:
    for opt in OPTIMIZERS:
        ref = reference(model_cfg=TIED, seq_len=16, optimizer=opt)
        try:
            assert_close_runs(ref, got[opt])
        except AssertionError as e:
            raise AssertionError(f"{label} {opt}: {e}") from None
        # Both ends hold one weight: the pipeline's two copies stay bit-identical, and equal the tied reference.
        assert torch.equal(got[opt]["state"][EMBED], got[opt]["state"][HEAD]), (label, opt)


@contextlib.contextmanager
def embedding_group_not_all_reduced() -> Iterator[list]:
    """The mutation: each end of the pipeline steps its copy with its own gradient only."""
    fired: list = []

    def skip(self: TiedStages, grads: list[torch.Tensor]) -> None:
        fired.append(len(grads))

    with _patched(TiedStages, "all_reduce_grads", skip):
        yield fired


@contextlib.contextmanager
def tied_weight_counted_twice_in_the_norm() -> Iterator[list]:
    """The mutation: the last stage's copy counts in the global gradient norm too."""
    fired: list = []
    init = TiedStages.__init__

    def both_count(self: TiedStages, params: list, group: object, replica: bool, placements: object) -> None:
        fired.append(replica)
        init(self, params, group, False, placements)

    with _patched(TiedStages, "__init__", both_count):
        yield fired


def _pp2_and_mutation(runs: list) -> dict:
    out = {"runs": _runs(runs)}
    for label, mutation in (
        ("no all-reduce", embedding_group_not_all_reduced),
        ("norm", tied_weight_counted_twice_in_the_norm),
    ):
        with mutation() as fired:
            run = train_layout(
                "pp=2", {"schedule": "1f1b"}, steps=MUTATED_STEPS, micro_batch=2, model_cfg=TIED, seq_len=16
            )
        out[label] = {**run, "fired": any(fired)}
    return out


def test_tied_pp2_matches_single_process_and_the_mutations_are_caught():
    """1F1B against one process; dropping the embedding-group all-reduce, or counting the last stage's copy
    in the gradient norm, fails the loss criterion (its gradient norms, and the clipped steps)."""
    runs = [("pp=2", {"schedule": "1f1b"}, 2)]
    results = run_shared(_pp2_and_mutation, 2, runs)
    for rank in results:
        for run, got in zip(runs, rank["runs"], strict=True):
            _assert_matches_reference(got, run)
    ref = reference(model_cfg=TIED, seq_len=16, steps=MUTATED_STEPS)
    for mutation in ("no all-reduce", "norm"):
        assert any(rank[mutation]["fired"] for rank in results), f"{mutation}: the mutation never fired"
        assert "losses" in criterion_failures(ref, results[0][mutation]), mutation


def test_tied_pp2_interleaved_and_zero_bubble_schedules():
    runs = [("pp=2", {"schedule": "interleaved", "virtual_stages": 2}, 2), ("pp=2", {"schedule": "zb1"}, 1)]
    for rank in run_shared(_runs, 2, runs):
        for run, got in zip(runs, rank, strict=True):
            _assert_matches_reference(got, run)


def test_tied_tp2_matches_single_process():
    runs = [("tp=2", {}, 0), ("tp=2", {"sequence_parallel": True}, 0)]
    for rank in run_shared(_runs, 2, runs):
        for run, got in zip(runs, rank, strict=True):
            _assert_matches_reference(got, run)


@pytest.mark.slow  # four compositions on four ranks: ~13 s on two cores
def test_tied_pp_with_dp_zero_tp_and_pp4():
    runs = [
        ("pp=2,dp=2", {"schedule": "1f1b", "zero": 1}, 1),
        ("pp=2,dp=2", {"schedule": "zb1", "zero": 3}, 1),  # the tied weight is a ZeRO-3 buffer of its own
        ("pp=2,tp=2", {"schedule": "gpipe", "sequence_parallel": True}, 2),
        ("pp=4", {"schedule": "1f1b"}, 2),  # the embedding group is a group of its own: ranks 0 and 3
    ]
    for run, got in zip(runs, run_shared(_runs, 4, runs)[0], strict=True):
        _assert_matches_reference(got, run)


def _save_at_pp2(run_dir: str) -> dict:
    return train_layout(
        "pp=2", {"schedule": "1f1b"}, micro_batch=2, model_cfg=TIED, seq_len=16, stop=5, save_to=run_dir
    )


def test_a_tied_checkpoint_saved_at_pp2_resumes_in_one_process(tmp_path: Path):
    saved = run_shared(_save_at_pp2, 2, str(tmp_path))[0]
    resumed = train_layout("", model_cfg=TIED, seq_len=16, start=5, resume_from=str(tmp_path))
    assert_identical_weights(saved["state"], resumed["resumed_state"])
    assert_close_runs(tail(reference(model_cfg=TIED, seq_len=16, optimizer="adamw"), 5), resumed)


def tied_gpt2() -> torch.nn.Module:
    """A user's model (tests/parallel/test_api.py's GPT-2 style) whose head reuses its token embedding: the tie is the
    module graph's (one Parameter, two modules), there is no config field saying so."""
    from test_api import gpt2

    model = gpt2()
    model.head.weight = model.wte.weight
    return model


def _user_model_runs(layouts: list[tuple[str, dict]]) -> list[dict]:
    from test_api import api_run

    return [api_run(layout, model_fn=tied_gpt2, **kwargs) for layout, kwargs in layouts]


def test_a_users_tied_model_under_pp2_and_tp2_matches_one_process():
    from test_api import api_run

    layouts = [("pp=2", {"micro_batches": 2}), ("tp=2", {})]
    ref = api_run("", model_fn=tied_gpt2)
    for rank in run_shared(_user_model_runs, 2, layouts):
        for (layout, _), got in zip(layouts, rank, strict=True):
            assert_close_runs(ref, got)
            assert torch.equal(got["state"]["wte.weight"], got["state"]["head.weight"]), layout


def tied_hf_llama() -> torch.nn.Module:
    from test_api import hf_llama

    model = hf_llama()
    model.lm_head.weight = model.model.embed_tokens.weight  # what tie_word_embeddings: true builds
    return model


def _hf_tp2() -> dict:
    from test_api import api_run

    return api_run("tp=2", model_fn=tied_hf_llama, plan=None)


@pytest.mark.slow  # two fresh ranks importing transformers: ~10 s
def test_a_tied_hf_llama_object_under_tp2_matches_one_process():
    pytest.importorskip("transformers")
    from test_api import api_run

    ref = api_run("", model_fn=tied_hf_llama, plan=None)
    for got in run_shared(_hf_tp2, 2):
        assert_close_runs(ref, got)
        assert torch.equal(got["state"]["model.embed_tokens.weight"], got["state"]["lm_head.weight"])


# ---- plans that cannot keep a tie are refused in one line ------------------------------------------------
def test_a_tp_plan_that_splits_one_side_of_a_tie_is_refused():
    model = Transformer(TIED)
    plan = plan_for(model)
    check_tp_plan(model, plan, 2, False)  # both vocab-parallel: one shard
    only_head = {k: v for k, v in plan.tensor_parallel.items() if k != "model.embed_tokens"}
    other_style = {**plan.tensor_parallel, "lm_head": "colwise"}
    for table, styles in ((only_head, "not in tensor_parallel) and lm_head (vocab_head"), (other_style, "colwise")):
        with pytest.raises(PlanError) as e:
            check_tp_plan(model, dataclasses.replace(plan, tensor_parallel=table), 2, False)
        line = str(e.value)
        assert "\n" not in line and "model.embed_tokens (" in line and styles in line
        assert "valid: model.embed_tokens: vocab_embedding and lm_head: vocab_head, or neither" in line
    untied = Transformer(TEST_MODEL)  # the same tables are fine without a tie
    check_tp_plan(untied, dataclasses.replace(plan, tensor_parallel=only_head), 2, False)


class SharedBlocks(torch.nn.Module):
    """Two blocks sharing one Linear (ALBERT-style): a tie no pipeline can keep."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        shared = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(shared), torch.nn.Sequential(shared)])
        self.head = torch.nn.Linear(4, 8)


def test_only_a_first_last_tie_can_be_pipelined():
    model = Transformer(TIED)
    placements = Placements()
    chunks = [split_model(model, r, 2, placements=placements) for r in range(2)]
    first, last = chunks[0][0], chunks[1][0]
    assert first.model.embed_tokens.weight is last.lm_head.weight is model.lm_head.weight
    assert placements[model.lm_head.weight].pp_tied
    assert not placements[model.model.norm.weight].pp_tied
    plan = ParallelPlan("shared", pipeline=PipelineSplit(layers="blocks", first=("embed",), last=("head",)))
    with pytest.raises(PlanError, match=r"blocks\.0\.0\.weight and blocks\.1\.0\.weight .* two pipeline parts"):
        split_model(SharedBlocks(), 0, 2, plan=plan)


# ---- every command that reads a run ---------------------------------------------------------------------
def _train_tied_at_pp2(overrides: list[str]) -> list[dict]:
    from equivalence import trainer_runs

    return trainer_runs([overrides])


def test_eval_generate_and_convert_of_a_tied_run(data_cache: str, tmp_path: Path, capsys):
    transformers = pytest.importorskip("transformers")
    from run_args import small_run_args

    from meshlm.convert import load_checkpoint_model

    run_dir = tmp_path / "run"
    overrides = [*small_run_args(data_cache, run_dir), "--model.tie_embeddings", "true"]
    overrides += ["--train.steps", "3", "--train.eval_every", "3"]
    overrides += ["--parallel.layout", "pp=2", "--train.micro_batch", "4"]
    logged = run_shared(_train_tied_at_pp2, 2, overrides)[0][0]["eval"][-1][1]

    assert main(["eval", str(run_dir)]) == 0
    assert f"validation loss {logged:.4f}" in capsys.readouterr().out
    assert main(["generate", str(run_dir), "--prompt", "def f(", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def f(")

    hf_dir = tmp_path / "hf"
    assert main(["convert", "meshlm-to-hf", str(run_dir), str(hf_dir)]) == 0
    assert json.loads((hf_dir / "config.json").read_text())["tie_word_embeddings"] is True
    from safetensors.torch import load_file

    assert HEAD not in load_file(hf_dir / "model.safetensors")  # stored once, as HF stores a tie
    model, _ = load_checkpoint_model(run_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, TIED.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model.eval()(tokens), hf_model(tokens).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # fp32, same math in another order

    back = tmp_path / "back.safetensors"
    assert main(["convert", "hf-to-meshlm", str(hf_dir), str(back)]) == 0
    assert main(["convert", "meshlm-to-hf", str(back), str(tmp_path / "hf2")]) == 0
    assert load_file(tmp_path / "hf2" / "model.safetensors").keys() == load_file(hf_dir / "model.safetensors").keys()


def _init_from_at_pp2(directory: str) -> dict:
    from test_init_from import set_up

    return set_up(directory, "pp=2")


@pytest.mark.slow  # two fresh ranks importing transformers: ~10 s
def test_init_from_a_tied_hf_checkpoint_at_pp2(tmp_path: Path):
    """A Llama-3.2-shaped HF checkpoint (tie_word_embeddings: true), built on meta at pp=2: both ends read the
    one stored embedding, and the step-0 loss and the weights equal transformers'."""
    pytest.importorskip("transformers")
    from test_init_from import assert_equals_transformers, make_hf_model, save_checkpoint

    directory = save_checkpoint(make_hf_model(tie=True), tmp_path / "tied")
    for run in run_shared(_init_from_at_pp2, 2, str(directory)):
        assert_equals_transformers(run, directory)
        assert torch.equal(run["state"][EMBED], run["state"][HEAD])
