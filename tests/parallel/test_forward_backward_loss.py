"""`model.forward_backward(x, y, loss_fn)` trains on `loss_fn` (docs/api.md): the per-token loss given for the call
replaces the model's for that call, and only for it. Before, the call set an attribute nothing read and trained on
the default cross-entropy, silently (mutation: restore that and the first test fails: the loss is the default's,
not twice it). Where another loss cannot be computed (a head fused with meshlm's cross-entropy) it is refused in
one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshlm
from meshlm.model.config import preset
from meshlm.model.llama import Transformer
from meshlm.parallel.mesh import build_mesh, parse_layout
from meshlm.parallel.parallel_plan import PlanError

MODEL = preset("test")


def _world_of_one() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, MODEL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    return data[:, :-1], data[:, 1:]


def _model(**loss: object) -> meshlm.ParallelModel:
    _world_of_one()
    torch.manual_seed(0)
    return meshlm.parallelize(Transformer(MODEL), build_mesh(parse_layout("", 1), "cpu"), loss=meshlm.Loss(**loss))


def doubled(output: object, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    return 2 * F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view_as(targets)


def test_the_call_s_loss_replaces_the_model_s_for_that_call() -> None:
    x, y = _batch()
    default = _model().forward_backward(x, y).item()
    model = _model()
    # The same fp32 graph times 2: equal up to summation order (the suite's 1e-5 loss criterion).
    assert model.forward_backward(x, y, doubled).item() == pytest.approx(2 * default, rel=1e-5)
    model.zero_grad()
    assert model.forward_backward(x, y).item() == pytest.approx(default, rel=1e-5)  # the model's again


def test_a_fused_head_refuses_another_loss_in_one_line() -> None:
    x, y = _batch()
    with pytest.raises(PlanError, match=r"^forward_backward\(loss_fn\): the head computes meshlm's cross-entropy"):
        _model(fused=True).forward_backward(x, y, doubled)
