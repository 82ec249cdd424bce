"""A fine-tune end to end, as a team runs one (issue #28's acceptance): `init_from` a random tied Llama-3.2-shaped
Hugging Face checkpoint with its ChatML tokenizer, supervised fine-tuning on a small jsonl of conversations under
dp=2×tp=2 and under pp=2 (the tied embedding on both pipeline ends), then `meshlm eval`, `meshlm generate` and
`meshlm convert meshlm-to-hf`; transformers loads the export (tied, with its chat template) and its loss on the
validation batch, -100 labels ignored, equals the loss meshlm logged for it (fp32 both sides: 1e-5 relative,
the suite's loss tolerance).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_shared
from equivalence import trainer_runs
from sft_data import CHATML, VOCAB, hf_tokenizer_dir, sft_cfg

from meshlm.cli import main
from meshlm.config import load_config, parse_overrides
from meshlm.data import prepare_data

SEQ = 48


def _train_args(hf_dir: Path, tmp_path: Path, run_dir: Path, layout: str) -> list[str]:
    cfg = sft_cfg(tmp_path, seq_len=SEQ)
    return [
        "--model.init_from", str(hf_dir), "--data.format", "sft", "--data.source", cfg.source,
        "--data.cache_dir", cfg.cache_dir, "--data.seq_len", str(SEQ), "--data.val_fraction", "0.1",
        "--train.steps", "3", "--train.global_batch", "4", "--train.lr", "1e-3", "--train.warmup_steps", "1",
        "--train.eval_every", "3", "--train.eval_batches", "1", "--train.device", "cpu",
        "--train.micro_batch", "2" if layout == "pp=2" else "0",
        "--parallel.layout", layout, "--checkpoint.async_save", "false", "--log.run_dir", str(run_dir),
        "--log.progress", "false", "--log.tensorboard", "false", "--fault.watchdog_s", "0",
    ]  # fmt: skip


@pytest.mark.slow  # two short multi-rank fine-tunes (four and two ranks), then eval, generate, export: ~40 s
def test_tied_hf_checkpoint_sft_under_dp_tp_and_pp_exports_to_transformers_with_equal_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    hf_tokenizer_dir(hf_dir, CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|im_end|>", jinja=True)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    )  # fmt: skip  (Llama 3.2 1B/3B tie their embeddings)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)

    runs = {"dp=2,tp=2": (4, tmp_path / "run-dp-tp"), "pp=2": (2, tmp_path / "run-pp")}
    for layout, (world, run_dir) in runs.items():
        args = _train_args(hf_dir, tmp_path, run_dir, layout)
        run_shared(trainer_runs, world, [args], timeout=600)

    for layout, (_, run_dir) in runs.items():
        assert main(["eval", str(run_dir)]) == 0
        assert "step_00000003: validation loss" in capsys.readouterr().out
        prompt = "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
        assert main(["generate", str(run_dir), "--prompt", prompt, "--max-new-tokens", "4"]) == 0
        assert capsys.readouterr().out.startswith(prompt)
        out = tmp_path / f"export-{run_dir.name}"
        assert main(["convert", "meshlm-to-hf", str(run_dir), str(out)]) == 0

        hf = transformers.AutoTokenizer.from_pretrained(out)
        assert hf.chat_template == CHATML
        exported = json.loads((out / "config.json").read_text())
        assert exported["tie_word_embeddings"] is True, layout
        model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        args = _train_args(hf_dir, tmp_path, run_dir, layout)
        data = prepare_data(load_config(None, parse_overrides(args)).data, VOCAB, hf_dir / "tokenizer.json")
        x, y = next(data.eval_batches(SEQ, batch=4, n_batches=1))
        assert (y == -100).any()
        with torch.no_grad():
            logits = model(x).logits
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
        evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        got = [r["loss"] for r in evals if r["kind"] == "eval"][-1]
        assert abs(got - want) <= 1e-5 * want, (layout, got, want)
