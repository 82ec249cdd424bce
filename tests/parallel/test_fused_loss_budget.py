"""The fused loss's chunks, weight-gradient accumulation and compiled body (meshlm.parallel.transforms.fused_loss).

- Chunks are sized by a memory budget (CHUNK_BYTES of fp32 logits: thousands of tokens, not 261), the
  planner's copy is the same budget, and a run takes exactly ⌈tokens / chunk⌉ chunks.
- The head-weight gradient is summed over chunks in fp32: with many chunks it equals the unfused gradient to
  fp32 rounding. Mutation (each chunk's partial rounded to bf16 before the sum, what the loss did before:
  `self.acc.addmm_(grad.t(), hidden)` → `self.acc += (grad.t() @ hidden).bfloat16().float()` in
  `_WeightGrad.add`) fails `test_weight_gradient_summed_over_chunks_in_fp32` at ~1e-3.
- On the CPU, whose bf16 GEMM cannot write fp32, bf16 autocast runs one chunk whatever the budget (chunked, the
  weight gradient would need an fp32 GEMM, slower than unfused). Mutation (`chunk_tokens` ignoring "none")
  fails `test_cpu_bf16_runs_one_chunk`.
- With compile on, the chunk body is torch.compiled with the blocks' backend and gives the eager loss.
  Mutation (strategy.py's FusedLoss not passing the backend) fails `test_parallelize_compiles_the_loss_body`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from equivalence import TEST_MODEL

from meshlm.model import Transformer, token_cross_entropy
from meshlm.parallel.engine import parallelize
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.options import Loss
from meshlm.parallel.plan_registry import LLAMA
from meshlm.parallel.transforms import fused_loss
from meshlm.parallel.transforms.fused_loss import HeadOutput, chunk_tokens, fused_cross_entropy_sum
from meshlm.plan.memory import LOSS_CHUNK_BYTES, Workload, loss_chunk_bytes
from meshlm.testing import mask_prompts


@contextlib.contextmanager
def _counting_chunks() -> Iterator[list[int]]:
    """The token count of every chunk the loss's body sees (the eager body: looked up at each call)."""
    seen: list[int] = []
    original = fused_loss._softmax_grad

    def counted(logits: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(logits.shape[0])
        return original(logits, *args)

    fused_loss._softmax_grad = counted
    try:
        yield seen
    finally:
        fused_loss._softmax_grad = original


def _inputs(tokens: int, vocab: int, dim: int = 32):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, tokens, dim, generator=g)
    weight = torch.randn(vocab, dim, generator=g) * 0.3
    targets = mask_prompts(torch.randint(0, vocab, (1, tokens), generator=g), 0, 0.3)
    return hidden, weight, targets


def test_chunks_hold_thousands_of_tokens_and_the_planner_reads_the_same_budget() -> None:
    assert fused_loss.CHUNK_BYTES == LOSS_CHUNK_BYTES == 1 << 30
    assert chunk_tokens(131_072) == 2048 and chunk_tokens(32_768) == 8192 and chunk_tokens(128_256) == 2092
    from meshlm.model import preset
    from meshlm.parallel.mesh import Layout
    from meshlm.plan.memory import Candidate

    cfg = preset("llama3-1b")
    for tp in (1, 2):
        s = Candidate(Layout(tp=tp), micro_batch=8)
        vocab = cfg.vocab_size // tp
        # bf16: one chunk's fp32 logits and their bf16 gradient, the runtime's chunk of the 8×2048 tokens.
        assert loss_chunk_bytes(Workload(cfg, 2048, 8, 1e9, "bf16"), s) == chunk_tokens(vocab) * vocab * 6


def test_a_run_takes_ceil_tokens_over_chunk_chunks(monkeypatch) -> None:
    hidden, weight, targets = _inputs(50, 40)
    monkeypatch.setattr(fused_loss, "CHUNK_BYTES", 4 * 40 * 16)  # 16 tokens of fp32 logits
    with _counting_chunks() as seen:
        fused_cross_entropy_sum(HeadOutput(hidden, weight), targets)
    assert seen == [16, 16, 16, 2]


def _grads(fn, hidden, weight):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fn(h, w).backward()
    return h.grad, w.grad


def test_weight_gradient_summed_over_chunks_in_fp32(monkeypatch) -> None:
    """64 chunks of 8 tokens: the fp32 sum of the chunks' partials is the unfused gradient up to fp32 rounding
    (1e-6: the same products summed in another order, ~1e-7 apart); a bf16 rounding of each partial is 2^-9
    relative per element, ~1e-3 here."""
    hidden, weight, targets = _inputs(512, 64)
    _, ref = _grads(lambda h, w: token_cross_entropy(h @ w.t(), targets).sum(), hidden, weight)
    monkeypatch.setattr(fused_loss, "CHUNK_BYTES", 4 * 64 * 8)
    with _counting_chunks() as seen:
        _, got = _grads(lambda h, w: fused_cross_entropy_sum(HeadOutput(h, w), targets), hidden, weight)
    assert len(seen) == 64
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-6, rel


def test_cpu_bf16_runs_one_chunk(monkeypatch) -> None:
    """Under bf16 autocast on the CPU (no fp32-output bf16 GEMM) the budget is not applied: one chunk, the
    weight gradient one bf16 product rounded once, like the unfused head's — so within bf16 rounding of it
    (2^-8 relative: both round a product of the same bf16 operands, whose fp32 softmax gradients differ by
    fp32 rounding) — while an fp32 run on the same budget takes four chunks."""
    hidden, weight, targets = _inputs(64, 40)
    monkeypatch.setattr(fused_loss, "CHUNK_BYTES", 4 * 40 * 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, ref = _grads(lambda h, w: token_cross_entropy(h @ w.t(), targets).sum(), hidden, weight)
        with _counting_chunks() as seen:
            _, got = _grads(lambda h, w: fused_cross_entropy_sum(HeadOutput(h, w), targets), hidden, weight)
    assert seen == [64]
    assert ((got - ref).norm() / ref.norm()).item() < 2**-8
    with _counting_chunks() as seen:
        fused_cross_entropy_sum(HeadOutput(hidden, weight), targets)
    assert seen == [16] * 4


def test_compiled_body_equals_the_eager_loss(monkeypatch) -> None:
    """compile_backend compiles the chunk body (aot_eager: dynamo and AOTAutograd traced, eager kernels — the
    same ops, so equal to fp32 rounding, 1e-6), several chunks, one of them short; dynamo captured it."""
    hidden, weight, targets = _inputs(40, 24)
    monkeypatch.setattr(fused_loss, "CHUNK_BYTES", 4 * 24 * 16)
    eager = _grads(lambda h, w: fused_cross_entropy_sum(HeadOutput(h, w), targets), hidden, weight)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _grads(
        lambda h, w: fused_cross_entropy_sum(HeadOutput(h, w, compile_backend="aot_eager"), targets), hidden, weight
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_parallelize_compiles_the_loss_body() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = build_mesh(parse_layout("", 1), "cpu")
    for options, backend in (({"compile": True, "compile_backend": "aot_eager"}, "aot_eager"), ({}, None)):
        with torch.device("meta"):
            model = Transformer(TEST_MODEL, init_seed=0)
        parallelize(model, mesh, options, plan=LLAMA, loss=Loss(fused=True))
        assert model.lm_head.compile_backend == backend
