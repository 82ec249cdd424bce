"""`meshlm.check`: correct layouts pass against one process (meshlm's plan at pp=2 interleaved; through
`meshlm check`, HF Llama at tp=2 SP, Qwen2 with LoRA and Mixtral at ep=2 from init_from; dp=2 ZeRO-3 in
test_check_noise.py); the suite's mutations (a wrong plan entry, a missing gradient sum over tp, a tied weight
counted twice in the norm, a dp gradient reduction and a LoRA adapter's reduction applied twice) fail and are
localised to the module responsible; a half-tied plan is refused in one line naming both modules.

Each check starts torchrun several times (world 1, the layout, the resume; on a failure the gradient runs),
~10-20 s each on a loaded 2-core machine, so these tests are slow.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import json
import os
import sys

import pytest
from equivalence import dp_gradients_all_reduced_twice, tp_input_gradient_not_all_reduced
from run_args import small_run_args
from test_tied import TIED, tied_weight_counted_twice_in_the_norm

import meshlm
from meshlm.check.run import CheckError
from meshlm.cli import main
from meshlm.model import Transformer, preset
from meshlm.parallel.plan_registry import LLAMA
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


def dp_gradient_reduced_twice() -> Transformer:
    _BUGS.enter_context(dp_gradients_all_reduced_twice())
    return Transformer(MODEL)


def tied_counted_twice_in_the_norm() -> Transformer:
    _BUGS.enter_context(tied_weight_counted_twice_in_the_norm())
    return Transformer(TIED)


def batches() -> list:
    return [global_batch(step, 8, 32, MODEL.vocab_size) for step in range(5)]


# Passing layouts not run elsewhere. Run elsewhere, so not here (three torchrun starts each): meshlm's Llama
# plan at tp=2 with sequence parallel (test_the_cli_json_and_exit_code's "llama init_from tp=2 sp export";
# test_check_noise.py at tp=2 for five steps) and dp=2 ZeRO-3, which holds only the shards between steps, so
# the check reads a rank's own copies of the weights only where they are in memory (it read freed storage and
# the ranks died of SIGSEGV: test_check_noise.py's "dp=2 zero3" case)
PASSING = {
    "pp=2 interleaved x2": ("pp=2", {"schedule": "interleaved", "virtual_stages": 2, "micro_batch": 2}),
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
    # each gradient all-reduced twice over dp: every gradient 2x one process's, the step-1 loss equal (AdamW
    # hardly moves: the losses stay within 1e-5, the norm does not); named as the reduction all tensors share
    "dp gradient reduced twice": (
        dp_gradient_reduced_twice, LLAMA, "dp=2", {},
        "every tensor: grad is 2x one process's", "reduced over dp", "dp=1",
    ),
}  # fmt: skip


@pytest.mark.slow  # per mutation 5 torchrun starts (no resume after a failure): 29-65 s each on 2 shared cores
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutations_fail_and_are_localised(mutation: str, tmp_path) -> None:
    factory, plan, layout, parallel, culprit, placement, exact = MUTATIONS[mutation]
    report = meshlm.check(factory, batches(), layout, plan=plan, workdir=tmp_path, **parallel)
    out = json.loads(report.to_json())  # what `meshlm check --json` prints, less kept/shrunk
    assert set(out) == {"layout", "passed", "checks", "phases_s", "culprit"} and out["layout"] == layout
    assert not out["passed"] and not out["checks"][0]["passed"], out
    assert [c["check"] for c in out["checks"]] == [f"5 steps at {layout} vs world 1", "step-1 gradients per tensor"]
    assert out["culprit"].startswith(culprit), out["culprit"]
    assert placement in out["culprit"] and f"exact with {exact}" in out["culprit"], out["culprit"]
    # the run without the layout's one dimension is the world-1 reference's job: not started again (same_job)
    assert not [phase for phase in out["phases_s"] if phase.endswith(f" at {exact}")], out["phases_s"]


@pytest.mark.slow  # one torchrun start, refused: 5-14 s on 2 shared cores
def test_a_half_tied_plan_is_refused_naming_both_modules_before_the_reference(tmp_path) -> None:
    with pytest.raises(CheckError) as e:
        meshlm.check(make_tied, batches(), "tp=2", plan=HALF_TIED, workdir=tmp_path)
    line = str(e.value)
    assert "\n" not in line and "model.embed_tokens (not in tensor_parallel) and lm_head (vocab_head)" in line, line
    assert "refused: plan 'llama'" in line and "[rank" not in line, line  # the ranks' line, not their traceback's
    assert not (tmp_path / "reference").exists()  # the layout runs first: refused before any other work


def aborting_model() -> Transformer:
    """A model factory whose rank 1 dies as a C++ abort kills a process (std::terminate: SIGABRT, no Python
    exception); rank 0 and the caller's process (no RANK) build the model."""
    if os.environ.get("RANK") == "1":
        ctypes.CDLL(None).abort()
    return Transformer(MODEL)


@pytest.mark.slow  # one torchrun start of two ranks: 8-25 s on 2 shared cores
def test_a_rank_killed_by_a_signal_is_named_with_its_python_stack(tmp_path) -> None:
    with pytest.raises(CheckError) as e:
        meshlm.check(aborting_model, batches(), "dp=2", plan=LLAMA, workdir=tmp_path)
    line = str(e.value)
    assert "\n" not in line and "failed: rank 1 died of SIGABRT (Fatal Python error: Aborted)" in line, line
    log = (tmp_path / "layout.log").read_text()  # the rank's Python stack (faulthandler), down to the abort
    assert log.count("Fatal Python error: Aborted") == 1 and "in aborting_model" in log, log


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


# `meshlm check --json` on a run's config: (overrides, the HF family init_from starts from or None, a suite
# mutation "module:name" injected into every Python process the check starts or None; on a mutation how the
# culprit starts, its placement and the dimension whose removal makes it exact). Two steps, the fewest the
# check runs (one before the resume, one after): each case is three torchrun starts or more.
CLI = {
    # a reduction applied twice: the row-parallel LoRA adapter's partial output all-reduced on its own and again
    # with the base's. Its B is zero at step 1, so step 1 is exact (gradients included); step 2's forward
    # differs from o_proj on, and every gradient with it: the first module output that differs names it
    "lora adapter reduced twice": (
        ["--parallel.layout", "tp=2", "--lora.rank", "4"], None, "test_lora:row_adapter_reduced_twice",
        ("model.layers.0.self_attn.o_proj: output differs", "sharded tp dim 1; first at step 2", "tp=1"),
    ),
    # an HF Llama (GQA) sliced into the replica, tp=2 with sequence parallel, exported to HF and back: passes
    "llama init_from tp=2 sp export": (["--parallel.layout", "tp=2", "--parallel.sequence_parallel", "true",
                                        "--export"], "llama", None, None),
    # an HF Qwen2 (q/k/v biases, tied embeddings) with LoRA adapters over its frozen base, dp=2,tp=2 ZeRO-1,
    # exported merged and as PEFT adapters on the sliced HF base: passes
    "qwen2 init_from lora dp=2,tp=2 export": (["--parallel.layout", "dp=2,tp=2", "--parallel.zero", "1",
                                               "--lora.rank", "4", "--export"], "qwen2", None, None),
    # an HF Mixtral (4 experts, top-2) with its experts sharded over ep=2: passes
    "mixtral init_from ep=2": (["--parallel.layout", "ep=2"], "mixtral", None, None),
}  # fmt: skip
HF_SHAPE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
}  # fmt: skip


def hf_checkpoint(family: str, directory) -> str:
    """A random HF model of `family` from a small transformers config, saved as a checkpoint (no download)."""
    import torch

    transformers = pytest.importorskip("transformers")
    config = {
        "llama": lambda: transformers.LlamaConfig(**HF_SHAPE),
        "qwen2": lambda: transformers.Qwen2Config(**HF_SHAPE, tie_word_embeddings=True),
        "mixtral": lambda: transformers.MixtralConfig(**HF_SHAPE, num_local_experts=4, num_experts_per_tok=2),
    }[family]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


@pytest.mark.slow  # corpus tokenized (shared with other tests), then 3-5 torchrun starts: 26-75 s on 2 shared cores
@pytest.mark.parametrize("case", CLI)
def test_the_cli_json_and_exit_code(case: str, data_cache, tmp_path, monkeypatch, capsys) -> None:
    """The mutation is injected by a sitecustomize on the ranks' path (the check passes them the caller's): the
    run's own config, the user's command, with a bug in meshlm's code."""
    overrides, family, mutation, culprit = CLI[case]
    if mutation:
        module, name = mutation.split(":")
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(
            f"from {module} import {name}\n\n"
            f"BUG = {name}()  # held: a collected one would undo the patch\n"
            "BUG.__enter__()\n"
        )
        monkeypatch.syspath_prepend(str(site))
    if family:
        overrides = [*overrides, "--model.init_from", hf_checkpoint(family, tmp_path / "hf")]
    run = small_run_args(data_cache, tmp_path / "run")
    args = ["check", "--json", "--steps", "2", "--workdir", str(tmp_path / "check"), *overrides, *run]
    code = 1 if mutation else 0
    assert main(args) == code
    out = json.loads(capsys.readouterr().out)  # stdout is the JSON alone (the tokenizer's lines go to stderr)
    assert set(out) == {"layout", "passed", "checks", "phases_s", "culprit", "kept", "shrunk"}, out
    assert out["passed"] == (code == 0) and out["checks"][0]["passed"] == (code == 0), out
    assert list(out["phases_s"])[:2] == ["shrink", "data"], out["phases_s"]
    if culprit:
        start, placement, exact = culprit
        assert out["culprit"].startswith(start), out["culprit"]
        assert placement in out["culprit"] and f"exact with {exact}" in out["culprit"], out["culprit"]
    else:
        assert all(c["passed"] for c in out["checks"]) and not out["culprit"], out
    exports = [c for c in out["checks"] if c["d_logits"] is not None]
    if "--export" in overrides:  # the round trip's rows, after the two training ones
        want = ["export to HF (merged) and back"] + ["PEFT adapters on the HF base"] * ("--lora.rank" in overrides)
        assert len(out["checks"]) == 2 + len(want) and [c["check"] for c in exports] == want, out
        assert all(c["d_logits"] <= 1e-5 for c in exports) and "export to HF and back" in out["phases_s"], out
    else:
        assert not exports and len(out["checks"]) == 2, out
    if family:  # the replica is the checkpoint's: its family, and its weights sliced from the checkpoint's
        assert f"family {family}" in out["kept"], out["kept"]
        assert any(line.startswith(f"init_from {tmp_path / 'hf'} -> ") for line in out["shrunk"]), out["shrunk"]
    if "--lora.rank" in overrides:
        assert any("LoRA" in line or "lora" in line for line in out["kept"]), out["kept"]
    if family == "mixtral":
        assert any(line.startswith("MoE top-2") for line in out["kept"]), out["kept"]


# `meshlm check --export` refuses in one line before any work (exit 2): (overrides, the module made missing, an HF
# base for init_from or None, what the line says)
EXPORT_REFUSED = {
    "no transformers": (["--model.preset", "test"], "transformers", None, "--export needs transformers"),
    "no peft for a LoRA run on an HF base": (["--lora.rank", "4"], "peft", "qwen2", "--export needs peft"),
    "an MoE the exporter refuses": (
        ["--model.preset", "tiny-moe", "--model.moe_score", "sigmoid"], None, None,
        "--export: model.moe_score='sigmoid' cannot be exported as Qwen2MoeForCausalLM (it needs 'softmax')",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", EXPORT_REFUSED)
def test_export_bad_input_is_one_line_before_work(case: str, tmp_path, monkeypatch, capsys) -> None:
    overrides, missing, family, line = EXPORT_REFUSED[case]
    if missing:
        monkeypatch.setitem(sys.modules, missing, None)  # as not installed: find_spec gives None, import fails
    if family:
        overrides = [*overrides, "--model.init_from", hf_checkpoint(family, tmp_path / "hf")]
        capsys.readouterr()  # transformers' progress bar while saving it
    workdir = tmp_path / "check"
    assert main(["check", "--export", "--workdir", str(workdir), "--data.seq_len", "32", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"meshlm: {line}"), err
    assert not workdir.exists()  # refused before the replica


def interleave_qk_rows(save_file):
    """A wrong export: q/k rows written in Meta's interleaved RoPE order (the permutation HF's own Llama
    conversion applies), not the rotate-half order transformers computes with."""

    def save(tensors: dict, path, metadata=None) -> None:
        for name, t in tensors.items():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                half = MODEL.head_dim // 2
                tensors[name] = t.view(-1, 2, half, t.shape[1]).transpose(1, 2).reshape(t.shape).contiguous()
        save_file(tensors, path, metadata=metadata)

    return save


def test_the_export_logits_tolerance_is_sharp(tmp_path, monkeypatch) -> None:
    """The export row's comparison (meshlm.check.export) on meshlm's model with LoRA adapters of a few steps'
    size: the merged export and the PEFT adapters on the exported base reproduce its logits within
    LOGITS_RTOL in transformers; q/k rows in another order, a merge without alpha/rank, or PEFT adapters written
    with lora_alpha = r, do not."""
    import torch

    import meshlm.model.hf_export as hf_export
    from meshlm.check.export import LOGITS_RTOL, hf_logits, logits_rel
    from meshlm.model.hf_export import export_hf
    from meshlm.parallel.transforms.lora import LoRALinear, LoRASpec, apply_lora, export_peft, lora_spec, merge_lora

    pytest.importorskip("peft")
    model = Transformer(MODEL, init_seed=0).eval()
    export_hf(model, tmp_path / "base")
    apply_lora(model, 4, 16.0, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B"):  # B starts at zero; after a few AdamW steps its elements are ~lr-sized
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 1e-3)
        tokens = batches()[0][0]
        ref = model(tokens)
    export_peft(model.state_dict(), lora_spec(model), tmp_path / "peft", str(tmp_path / "base"))
    merged = merge_lora(copy.deepcopy(model))
    export_hf(merged, tmp_path / "merged")
    assert logits_rel(hf_logits(tmp_path / "merged", tokens), ref) <= LOGITS_RTOL
    assert logits_rel(hf_logits(tmp_path / "base", tokens, tmp_path / "peft"), ref) <= LOGITS_RTOL

    with monkeypatch.context() as patch:
        patch.setattr(hf_export, "save_file", interleave_qk_rows(hf_export.save_file))
        export_hf(merged, tmp_path / "permuted")
    assert logits_rel(hf_logits(tmp_path / "permuted", tokens), ref) > 100 * LOGITS_RTOL
    unscaled = copy.deepcopy(model)
    for module in unscaled.modules():
        if isinstance(module, LoRALinear):
            module.lora_scaling = 1.0  # alpha/rank = 4 dropped
    export_hf(merge_lora(unscaled), tmp_path / "unscaled")
    assert logits_rel(hf_logits(tmp_path / "unscaled", tokens), ref) > 100 * LOGITS_RTOL
    export_peft(model.state_dict(), LoRASpec(4, 4.0, 0.0), tmp_path / "peft-unscaled", str(tmp_path / "base"))
    assert logits_rel(hf_logits(tmp_path / "base", tokens, tmp_path / "peft-unscaled"), ref) > 100 * LOGITS_RTOL


def test_the_peft_row_needs_an_hf_base(tmp_path) -> None:
    """PEFT adapters apply to an HF checkpoint: a LoRA run on one (model.init_from) gets the PEFT row, a LoRA run
    on a preset's seeded weights the merged row alone, a run without LoRA no PEFT row."""
    from meshlm.check.export import peft_base
    from meshlm.config import load_config

    hf = hf_checkpoint("llama", tmp_path / "hf")
    seq = ("data.seq_len", 64)  # within both models' max_seq_len
    assert peft_base(load_config(None, [seq, ("lora.rank", 4), ("model.init_from", hf)])) == hf
    assert peft_base(load_config(None, [seq, ("lora.rank", 4), ("model.preset", "test")])) is None
    assert peft_base(load_config(None, [seq, ("model.init_from", hf)])) is None
