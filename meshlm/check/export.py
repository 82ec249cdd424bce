"""`meshlm check --export`: the layout run's final checkpoint exported as `meshlm convert meshlm-to-hf` exports a
run (meshlm.convert.export_run: adapters merged; for a LoRA run on an HF base also its PEFT adapters), loaded
back with transformers (`AutoModelForCausalLM`; `peft.PeftModel` on the HF base for the adapters), and its
logits on the check's first batch compared with meshlm's model holding the reference run's (world 1) final
weights, a LoRA model's adapters unmerged (so a wrong merge shows).

Tolerance (fp32 on CPU): the compared weights already agree within the check's 1e-5 per tensor (the first
row), the export copies fp32 bytes (a merge adds one rounding of W + B·A·alpha/rank) and transformers computes
the same forward in another kernel order (its own attention, RoPE tables and RMSNorm): float32 rounding in
another order, ~1e-7 relative per operation over a few layers, so the logits, compared norm-wise over the
batch (‖Δ‖/‖logits‖), must agree within the same 1e-5 (measured 9e-8 on the Qwen2 LoRA replica at dp=2,tp=2).
A wrong export moves whole rows: on that replica (head_dim 4, an HF init's near-uniform attention, so the
smallest such effect) q/k rows in Meta's interleaved RoPE order move the merged row's logits by 9.5e-4, a
merge without alpha/rank by 4.8e-2, PEFT adapters written with lora_alpha = r the PEFT row's by 4.8e-2
(tests/integration/test_check.py::test_the_export_logits_tolerance_is_sharp checks the first two on the `test` preset).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch
from torch import nn

from meshlm.check.run import CheckError, CheckReport, Row
from meshlm.checkpoint import latest_valid_checkpoint, load_model_state
from meshlm.config import Config
from meshlm.convert import export_run, load_checkpoint_model, rebuild_run_model
from meshlm.model.hf_export import hf_config_from_model
from meshlm.model.pretrained import is_hf_directory

LOGITS_RTOL = 1e-5
LOGITS_WHY = "fp32: transformers' kernel order moves logits by ~1e-7 rel; a wrong export by ~1e-3 or more"


def peft_base(cfg: Config) -> str | None:
    """The HF directory a LoRA run's PEFT adapters apply to (its model.init_from), or None: no LoRA, or a base
    that is no HF checkpoint (a preset's seeded init, a meshlm run), which only the merged export holds."""
    init_from = cfg.model.init_from
    return init_from if cfg.lora.rank and init_from and is_hf_directory(init_from) else None


def check_export_input(cfg: Config) -> None:
    """Refuse `--export` in one line before any work: transformers (and peft, for a LoRA run on an HF base) not
    installed, or a model meshlm's exporter cannot write as its family's transformers class."""
    needed = {"transformers": "hf"} | ({"peft": "peft"} if peft_base(cfg) else {})
    for package, extra in needed.items():
        if importlib.util.find_spec(package) is None:
            raise CheckError(
                f"--export needs {package} to load the export back (pip install 'meshlm[{extra}]'), or leave "
                "--export out"
            )
    try:
        hf_config_from_model(cfg.model.build())
    except ValueError as e:
        raise CheckError(f"--export: {e}; without --export the check runs this model") from None


def reference_model(run_dir: Path) -> nn.Module:
    """meshlm's model of a run's newest checkpoint, as trained: a LoRA run's adapters kept unmerged."""
    checkpoint = latest_valid_checkpoint(run_dir)
    if checkpoint is None:
        raise CheckError(f"--export: {run_dir} has no valid checkpoint")
    state = load_model_state(checkpoint)
    if any(name.endswith(".lora_A") for name in state):
        return rebuild_run_model(checkpoint, state)[0]
    return load_checkpoint_model(checkpoint)[0]


@torch.no_grad()
def hf_logits(directory: Path, tokens: torch.Tensor, adapters: Path | None = None) -> torch.Tensor:
    """The logits of an HF directory's model on `tokens` (fp32, eval), with a PEFT adapter directory on it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # its "Loading weights" bar, on the check's own output
    model = AutoModelForCausalLM.from_pretrained(directory).float()  # fp32 as exported; older versions' default
    if adapters is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapters)
    return model.eval()(input_ids=tokens).logits


def logits_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got - ref‖ / ‖ref‖ over the whole batch."""
    return ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def add_export_rows(cfg: Config, workdir: Path, tokens: torch.Tensor, report: CheckReport, say) -> None:
    """The export round trip's rows and phase: the layout run's final checkpoint (`workdir`/layout) exported
    merged (and as PEFT adapters on an HF base) and loaded by transformers, its logits on `tokens` against the
    reference's (`workdir`/reference) model."""
    say("export to HF and back ...")
    begin = time.monotonic()
    with torch.no_grad():
        ref = reference_model(workdir / "reference").eval()(tokens)
    cases = [("export to HF (merged) and back", "merged", None)]
    if base := peft_base(cfg):
        cases.append(("PEFT adapters on the HF base", "peft", Path(base)))
    no_peft = "no PEFT row: the run's base (model.init_from) is no HF directory" if cfg.lora.rank and not base else ""
    for name, lora, base in cases:
        start = time.monotonic()
        out = workdir / f"export-{lora}"
        try:
            export_run(workdir / "layout", out, lora)
        except (ValueError, OSError) as e:
            report.rows.append(Row(name, None, None, None, "", time.monotonic() - start, False, f"export failed: {e}"))
            continue
        got = hf_logits(base, tokens, out) if base else hf_logits(out, tokens)
        d = logits_rel(got, ref)
        tolerance = f"logits <= {LOGITS_RTOL:g} ({LOGITS_WHY})"
        seconds = time.monotonic() - start
        note = no_peft * (lora == "merged")
        report.rows.append(Row(name, None, None, None, tolerance, seconds, d <= LOGITS_RTOL, note, d))
    report.phases["export to HF and back"] = round(time.monotonic() - begin, 2)
