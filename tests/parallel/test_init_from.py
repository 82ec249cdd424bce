"""`model.init_from`: fine-tuning from a Hugging Face checkpoint, each rank reading only its own slices.

The checkpoint is a random Llama 3.1-shaped model (llama3 RoPE scaling, GQA) built with transformers, saved
with a tokenizer. meshlm's step-0 loss must equal transformers' loss on the same batch (1e-5 relative, the
suite's loss criterion: the two compute the same fp32 graph, up to summation order) in one process and under
dp × tp ZeRO-3 and pp, with the weights set up bit-identical to the checkpoint's; every byte a rank reads is
recorded and bounded by what it keeps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_shared

transformers = pytest.importorskip("transformers")

from meshlm.cli import main  # noqa: E402
from meshlm.config import ConfigError, load_config  # noqa: E402
from meshlm.data import DataError, prepare_data, train_tokenizer  # noqa: E402
from meshlm.data.sampler import GlobalBatchSampler  # noqa: E402
from meshlm.model.hf import read_hf_config  # noqa: E402
from meshlm.model.llama import Transformer  # noqa: E402
from meshlm.model.pretrained import HFWeights  # noqa: E402
from meshlm.parallel.contract import LayoutSpec  # noqa: E402
from meshlm.parallel.engine import parallelize  # noqa: E402
from meshlm.parallel.mesh import build_mesh, parse_layout  # noqa: E402
from meshlm.parallel.strategies import check_layout  # noqa: E402
from meshlm.testing import global_batch  # noqa: E402
from meshlm.train.startup import open_init_from  # noqa: E402
from meshlm.train.trainer import fit  # noqa: E402

VOCAB, TOKENIZER_VOCAB, SEQ, BATCH = 320, 300, 16, 8
LOSS_RTOL = 1e-5  # the suite's loss criterion (tests/equivalence.py): same fp32 graph, other summation order
TEXT = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" * 3 for i in range(60)]


def make_hf_model(tie: bool, family: str = "llama") -> torch.nn.Module:
    extra = {"use_sliding_window": False} if family == "qwen2" else {}
    config = transformers.AutoConfig.for_model(
        family,
        **extra,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # sharp attention and non-unit norms, so a wrong mapping shows in the loss
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model


def save_checkpoint(model: torch.nn.Module, directory: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    tokenizer = train_tokenizer(TEXT, TOKENIZER_VOCAB)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("init_from")
    untied, tied = make_hf_model(tie=False), make_hf_model(tie=True)
    out = {
        "untied": save_checkpoint(untied, root / "untied"),
        "tied": save_checkpoint(tied, root / "tied"),
        "sharded": save_checkpoint(untied, root / "sharded", max_shard_size="40KB"),
        "qwen2": save_checkpoint(make_hf_model(tie=False, family="qwen2"), root / "qwen2"),  # q/k/v biases
    }
    assert (out["sharded"] / "model.safetensors.index.json").is_file()
    return out


@torch.no_grad()
def hf_loss(directory: Path, x: torch.Tensor, y: torch.Tensor) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()


def hf_state(directory: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class RecordingWeights(HFWeights):
    """Every region read from the checkpoint, as (tensor name, elements)."""

    def __init__(self, directory: str | Path, mutation: str | None = None) -> None:
        super().__init__(directory)
        # Mutations the checks must catch: "whole" reads whole tensors and slices them in memory, "tp_offset"
        # gives every tensor-parallel rank the first slice.
        self.mutation = mutation
        self.reads: list[tuple[str, int]] = []

    def fill(
        self, name: str, shape: tuple, local_shape: tuple, tp_slice: tuple | None, start: int, out: torch.Tensor
    ) -> None:
        if self.mutation == "tp_offset" and tp_slice is not None:
            tp_slice = (tp_slice[0], 0)
        super().fill(name, shape, local_shape, tp_slice, start, out)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if self.mutation == "whole":
            tensor = super().read(name, (slice(None),))
            self.reads.append((name, tensor.numel()))
            return tensor[index]
        tensor = super().read(name, index)
        self.reads.append((name, tensor.numel()))
        return tensor


def set_up(directory: str, layout: str, zero: int = 0, mutation: str | None = None) -> dict:
    """Build the checkpoint's model on meta under `layout`, materialised from the files; return the step-0
    loss of the global batch, the full weights, and what this rank read and keeps."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = read_hf_config(directory)
    lay = parse_layout(layout, dist.get_world_size())
    n_micro = check_layout(LayoutSpec(cfg, lay, BATCH, 2 if lay.pp > 1 else 0, SEQ))
    source = RecordingWeights(directory, mutation)
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=0, init_source=source)
    pm = parallelize(model, build_mesh(lay, "cpu"), {"zero": zero, "micro_batches": n_micro})
    held = pm.local_shards()["model"] if zero == 3 else [p for c in pm.chunks for p in c.parameters()]
    kept = sum(piece.local.numel() for piece in held) if zero == 3 else sum(p.numel() for p in held)
    x, y = global_batch(0, BATCH, SEQ, cfg.vocab_size)
    rows = slice(pm.mesh.rank("dp") * BATCH // lay.dp, (pm.mesh.rank("dp") + 1) * BATCH // lay.dp)
    loss = pm.forward_backward(x[rows], y[rows]).item()
    names = {n for c in pm.chunks for n, _ in c.named_parameters()}
    return {
        "loss": loss,
        "state": pm.full_state_dict(),
        "read": sum(n for _, n in source.reads),
        "read_names": {source.tensor_name(n) for n, _ in source.reads},
        "stage_names": {source.tensor_name(n) for n in names},
        "kept": kept,
        "n_params": len(names),
        "x": x,
        "y": y,
    }


def slack(run: dict) -> int:
    """Elements a rank may read beyond what it keeps: per parameter, the two partial rows at the ends of a
    ZeRO-3 flat range (rows are at most 96 wide here)."""
    return run["n_params"] * 2 * 96


def reads_only_its_own(run: dict) -> bool:
    """Only this stage's tensors, and no more elements than it keeps plus the slack."""
    return run["read_names"] <= run["stage_names"] and run["read"] <= run["kept"] + slack(run)


def assert_equals_transformers(run: dict, directory: Path) -> None:
    want = hf_loss(directory, run["x"], run["y"])
    assert abs(run["loss"] - want) <= LOSS_RTOL * abs(want), (run["loss"], want)
    state = hf_state(directory)
    for name, tensor in run["state"].items():
        assert torch.equal(tensor, state[name]), name  # copied, not computed: bit-identical


@pytest.mark.parametrize("kind", ["untied", "tied", "sharded"])
def test_single_process_step0_loss_equals_transformers(checkpoints: dict[str, Path], kind: str) -> None:
    run = set_up(str(checkpoints[kind]), "")
    assert_equals_transformers(run, checkpoints[kind])
    assert run["read"] == run["kept"] and reads_only_its_own(run)  # each tensor read once, whole


def test_bf16_checkpoint_is_upcast_on_the_copy(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["untied"]).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    run = set_up(str(tmp_path / "bf16"), "")
    for name, tensor in model.state_dict().items():
        assert run["state"][name].dtype == torch.float32 and torch.equal(run["state"][name], tensor.float()), name


def _runs(untied: str, sharded: str, tied: str, qwen2: str) -> dict[str, dict]:
    return {
        "dp2tp2z3": set_up(untied, "dp=2,tp=2", zero=3),
        "sharded dp2tp2z3": set_up(sharded, "dp=2,tp=2", zero=3),
        "pp2tp2": set_up(untied, "pp=2,tp=2"),
        "pp2dp2z1": set_up(untied, "pp=2,dp=2", zero=1),
        "tied dp2tp2z3": set_up(tied, "dp=2,tp=2", zero=3),
        "qwen2 dp2tp2z3": set_up(qwen2, "dp=2,tp=2", zero=3),
        # Mutations the checks must catch.
        "whole dp2tp2z3": set_up(untied, "dp=2,tp=2", zero=3, mutation="whole"),
        "whole pp2tp2": set_up(untied, "pp=2,tp=2", mutation="whole"),
        "tp_offset dp2tp2z3": set_up(untied, "dp=2,tp=2", zero=3, mutation="tp_offset"),
    }


def test_sharded_layouts_read_only_their_slices_and_match_transformers(checkpoints: dict[str, Path]) -> None:
    per_rank = run_shared(_runs, 4, *(str(checkpoints[k]) for k in ("untied", "sharded", "tied", "qwen2")))
    good = [label for label in per_rank[0] if label.split()[0] not in ("whole", "tp_offset")]
    for label in good:  # the loss and the full weights are global: every rank holds them
        kind = label.split()[0] if " " in label else "untied"
        assert_equals_transformers(per_rank[0][label], checkpoints[kind])
    for rank in per_rank:
        for label in good:
            run = rank[label]
            assert reads_only_its_own(run), (label, run["read"], run["kept"], run["read_names"] - run["stage_names"])
        # ZeRO-3 keeps a quarter of the model: reading this rank's whole tp slices (twice that) would fail.
        assert rank["dp2tp2z3"]["kept"] > 4 * slack(rank["dp2tp2z3"])
        # The checks are sharp: reading whole tensors and slicing them in memory fails the read bound...
        assert not reads_only_its_own(rank["whole dp2tp2z3"]) and not reads_only_its_own(rank["whole pp2tp2"])
    # ... and the wrong tensor-parallel slice the loss criterion.
    run = per_rank[0]["tp_offset dp2tp2z3"]
    want = hf_loss(checkpoints["untied"], run["x"], run["y"])
    assert abs(run["loss"] - want) > 100 * LOSS_RTOL * want
    stages = {frozenset(rank["pp2tp2"]["read_names"]) for rank in per_rank}
    assert len(stages) == 2 and not frozenset.intersection(*stages)  # pp=2: two stages, nothing read by both


def write_corpus(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir(exist_ok=True)
    for i, text in enumerate(TEXT):
        (corpus / f"doc{i:03d}.txt").write_text(text)
    return corpus


def fit_overrides(init_from: Path, root: Path, run_dir: Path, steps: int = 2) -> dict:
    return {
        "model.init_from": str(init_from),
        "data.source": str(write_corpus(root)),
        "data.cache_dir": str(root / "cache"),
        "data.seq_len": SEQ,
        "data.val_fraction": 0.1,
        "train.steps": steps,
        "train.global_batch": 4,
        "train.eval_every": 0,
        "train.device": "cpu",
        "checkpoint.async_save": False,
        "log.run_dir": str(run_dir),
        "log.tensorboard": False,
        "log.progress": False,
    }


def _fit_worker(runs: list[dict]) -> list[list[float]]:
    return [fit(load_config(None, list(overrides.items()))).losses for overrides in runs]


def test_fine_tuning_under_a_layout_matches_one_process(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The real trainer on 2 ranks: from the HF checkpoint under dp=2 ZeRO-3 and tp=2, and from a meshlm run
    (the one-process run's final checkpoint) under dp=2 ZeRO-3, each step's loss as in one process."""
    single = fit_overrides(checkpoints["untied"], tmp_path, tmp_path / "single", steps=3)
    reference = fit(load_config(None, list(single.items()))).losses
    again = fit_overrides(tmp_path / "single", tmp_path, tmp_path / "again-1", steps=3)
    reference_again = fit(load_config(None, list(again.items()))).losses
    runs = [
        single | {"log.run_dir": str(tmp_path / "dp"), "parallel.layout": "dp=2", "parallel.zero": 3},
        single | {"log.run_dir": str(tmp_path / "tp"), "parallel.layout": "tp=2"},
        again | {"log.run_dir": str(tmp_path / "again-2"), "parallel.layout": "dp=2", "parallel.zero": 3},
    ]
    results = run_shared(_fit_worker, 2, runs, timeout=400)[0]
    for got, want in zip(results, [reference, reference, reference_again], strict=True):
        assert got == pytest.approx(want, rel=LOSS_RTOL), (got, want)
    assert reference_again[0] != reference[0]  # the second starts from the first's trained weights


@pytest.mark.slow  # a one-process and a two-rank LoRA fine-tune of three steps each: ~15 s
def test_lora_on_a_tied_hf_checkpoint_under_pp(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """LoRA over a (tied) Hugging Face checkpoint's frozen base under pipeline parallel: the checkpoint trains
    as meshlm's Llama (an HF object cannot be pipelined, its forward cannot skip a stage's parts), its adapters
    on both stages, each step's loss as in one process."""
    lora = {"lora.rank": 4, "lora.alpha": 8.0, "train.lr": 1e-2}
    single = fit_overrides(checkpoints["tied"], tmp_path, tmp_path / "single", steps=3) | lora
    reference = fit(load_config(None, list(single.items()))).losses
    pp = single | {"log.run_dir": str(tmp_path / "pp"), "parallel.layout": "pp=2", "train.micro_batch": 2}
    (got,) = run_shared(_fit_worker, 2, [pp], timeout=400)[0]
    assert got == pytest.approx(reference, rel=LOSS_RTOL), (got, reference)
    assert reference[-1] != reference[0]  # the adapters train


def test_fine_tune_run_uses_the_tokenizer_and_exports_to_transformers(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = checkpoints["untied"]
    run_dir = tmp_path / "run"
    overrides = fit_overrides(directory, tmp_path, run_dir)
    cfg = load_config(None, list(overrides.items()))
    assert cfg.model.build() == read_hf_config(directory)
    result = fit(cfg)

    tokenizer_file = directory / "tokenizer.json"
    data = prepare_data(cfg.data, VOCAB, tokenizer_file)
    assert (data.directory / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    assert data.manifest["eot_id"] == data.tokenizer.token_to_id("<|endoftext|>")
    assert data.tokenizer.encode(TEXT[0]).ids == train_tokenizer(TEXT, TOKENIZER_VOCAB).encode(TEXT[0]).ids
    x, y = GlobalBatchSampler(data.train, SEQ, 4, cfg.train.seed).global_batch_at(0)
    want = hf_loss(directory, x, y)
    assert abs(result.losses[0] - want) <= LOSS_RTOL * want, (result.losses[0], want)
    assert result.losses[1] != result.losses[0]  # it trained

    out = tmp_path / "export"
    assert main(["convert", "meshlm-to-hf", str(run_dir), str(out)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (directory / name).read_bytes()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert fast(TEXT[0])["input_ids"] == data.tokenizer.encode(TEXT[0]).ids
    exported = hf_state(out)
    original = hf_state(directory)
    assert any(not torch.equal(exported[k], original[k]) for k in original)  # the fine-tuned weights
    from meshlm.convert import load_checkpoint_model

    model, _ = load_checkpoint_model(run_dir)
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported[name], tensor), name

    # A meshlm run as init_from: its model, weights and kept tokenizer; optimizer and data start afresh.
    again = load_config(
        None, list((overrides | {"model.init_from": str(run_dir), "log.run_dir": str(tmp_path / "again")}).items())
    )
    assert again.model.build() == model.cfg
    second = fit(again)
    with torch.no_grad():
        want = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert abs(second.losses[0] - want) <= LOSS_RTOL * want and second.start_step == 0, (second.losses[0], want)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()

    shard = next((run_dir / "checkpoints").glob("step_*/__0_0.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])  # a corrupt checkpoint: one line, before any training
    args = [f"--{key}={value}" for key, value in overrides.items() if key != "log.run_dir"]
    capsys.readouterr()
    assert main(["train", *args, f"--model.init_from={run_dir}", f"--log.run_dir={tmp_path / 'third'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("meshlm: model.init_from: ") and "__0_0.distcp" in err, err


def one_line_config_error(overrides: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides.items())).model.build()
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


def test_config_json_problems_are_one_line(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((checkpoints["untied"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"num_attention_heads": "4"}))
    message = one_line_config_error({"model.init_from": str(bad)})
    assert "bad: config.json: num_attention_heads='4' should be a positive integer" in message, message
    (bad / "config.json").write_text('{"vocab_size": 320,')
    message = one_line_config_error({"model.init_from": str(bad)})
    assert f"model.init_from: {bad / 'config.json'}: invalid JSON" in message, message
    message = one_line_config_error({"model.init_from": str(tmp_path / "absent")})
    assert f"model.init_from: {tmp_path / 'absent'} not found; valid: a Hugging Face checkpoint" in message
    message = one_line_config_error({"model.init_from": str(checkpoints["untied"] / "config.json")})
    assert f"model.init_from: {checkpoints['untied'] / 'config.json'} is not a checkpoint (no config.json" in message
    (tmp_path / "run" / "checkpoints" / ".staging-step_00000002").mkdir(parents=True)  # a run that never saved
    message = one_line_config_error({"model.init_from": str(tmp_path / "run")})
    assert f"{tmp_path / 'run'} is a meshlm run with no committed checkpoint yet" in message, message
    message = one_line_config_error({"model.init_from": str(checkpoints["untied"]), "model.dim": 128})
    assert f"model.dim: 128 conflicts with the model of model.init_from {checkpoints['untied']} (64)" in message
    agreeing = {"model.init_from": str(checkpoints["untied"]), "model.dim": 64, "model.preset": "small"}
    agreeing["data.seq_len"] = SEQ  # the preset is ignored; other fields may repeat the checkpoint's values
    assert load_config(None, list(agreeing.items())).model.build() == read_hf_config(checkpoints["untied"])


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_weight_file_problems_are_one_line(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    sharded = copy_checkpoint(checkpoints["sharded"], tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    with pytest.raises(ConfigError, match=rf"^model\.init_from: .*{shard}: shard listed in .*index\.json does not"):
        open_init_from(str(sharded), VOCAB)
    single = copy_checkpoint(checkpoints["untied"], tmp_path / "single")
    data = (single / "model.safetensors").read_bytes()
    for cut in (len(data) // 2, 5):
        (single / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(ConfigError) as info:
            open_init_from(str(single), VOCAB)
        assert f"{single / 'model.safetensors'}: not a valid safetensors file" in str(info.value)
        assert "\n" not in str(info.value)


def test_truncated_weights_stop_meshlm_train_in_one_line(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    single = copy_checkpoint(checkpoints["untied"], tmp_path / "single")
    data = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(data[: len(data) // 2])
    args = ["--model.init_from", str(single), "--data.source", str(write_corpus(tmp_path)), "--data.seq_len", "16"]
    args += ["--log.run_dir", str(tmp_path / "run"), "--train.device", "cpu", "--data.cache_dir", str(tmp_path)]
    capsys.readouterr()
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "model.safetensors: not a valid safetensors file" in err, err
    assert not (tmp_path / "run" / "config.toml").exists()  # stopped before any work


def test_tokenizer_problems_are_one_line_before_any_work(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    cfg = load_config(None, [("data.source", str(write_corpus(tmp_path))), ("data.cache_dir", str(tmp_path))])
    with pytest.raises(DataError) as info:
        prepare_data(cfg.data, 299, checkpoints["untied"] / "tokenizer.json")
    assert "tokenizer.json: 300 tokens do not fit the model's vocab_size 299" in str(info.value)
    directory = copy_checkpoint(checkpoints["untied"], tmp_path / "ckpt")
    for name, text, vocab, message in [  # what the trainer checks on every rank, before the data
        ("tokenizer.json", None, 299, "tokenizer.json: 300 tokens do not fit the model's vocab_size 299"),
        ("tokenizer.json", "{", VOCAB, "tokenizer.json: not a valid tokenizer.json ("),
        ("tokenizer_config.json", '{"eos_token": "</s>"}', VOCAB, "no document separator: '</s>' is not in"),
    ]:
        saved = (directory / name).read_bytes()
        (directory / name).write_text(text or saved.decode())
        with pytest.raises(DataError) as info:
            open_init_from(str(directory), vocab)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
        (directory / name).write_bytes(saved)
    assert open_init_from(str(directory), VOCAB) is not None
