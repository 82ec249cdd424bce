"""Set-up of a model built on the `meta` device: each rank allocates and initialises only what it keeps.

The engine applies tensor and pipeline parallelism to the meta model (slices of meta tensors are meta and
keep their `_meshlm_tp_slice` tags), then `MetaInit.replace_params` swaps every meta parameter of this rank's
chunks for a real one on the device: allocated and filled at once when the rank keeps it whole, or a
storage-less placeholder when data parallelism / ZeRO will pack it, whose FlatBuffer then fills only what
the rank holds (ZeRO-3: its flat shard, nothing else ever allocated). Peak set-up memory is the rank's shard,
not the model.

Values come from one of three sources:
  * the model's `init_source` when it has one (meshlm.model.pretrained.HFWeights, set by `model.init_from`):
    each rank's region read from a checkpoint's files, nothing else read;
  * the model's own `init_rule(name, param)` and `init_seed` (meshlm's Transformer): every element from
    meshlm.model.init, so each layout, and the one-process model, starts from bit-identical weights;
  * otherwise each module's `reset_parameters()`, run on a private copy of that one module (materialised
    with `to_empty`) under a seed derived from (seed, module name), and sliced: memory is one module at a
    time. Every rank then agrees on every value, but a layout does not reproduce a model built whole in one
    process (that one draws all modules from one RNG stream) unless the model defines its init per element.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshlm.model.init import InitRule, block_seed, fill_


def is_meta_model(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def agreed_seed(seed: int | None) -> int:
    """The model's init seed (else torch.initial_seed()) as global rank 0 has it: ranks seeded differently
    would otherwise build different shards of one model (a full build is repaired by dp's broadcast)."""
    box = [torch.initial_seed() if seed is None else seed]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


class MetaInit:
    """Where the initial value of any element of any (sliced) parameter of a meta-built model comes from.

    Captures the model's names, full shapes and modules before tensor parallelism changes it; collective (the
    seed is agreed over the world) and checked before anything is changed: a module without a way to
    initialise its meta tensors is named in a one-line ValueError."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.seed = agreed_seed(getattr(model, "init_seed", None))
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.source = getattr(model, "init_source", None)
        rule: Callable[[str, torch.Tensor], InitRule] | None = getattr(model, "init_rule", None)
        self.rules = {name: rule(name, p) for name, p in model.named_parameters()} if callable(rule) else None
        self.modules = dict(model.named_modules())
        for path, module in self.modules.items():
            own = self.rules is None and self.source is None  # parameters only module code can initialise
            meta_params = own and any(p.is_meta for p in module.parameters(recurse=False))
            meta_buffers = any(b.is_meta for b in module.buffers(recurse=False))
            if (meta_params or meta_buffers) and not callable(getattr(module, "reset_parameters", None)):
                what = "parameters" if meta_params else "buffers"
                raise ValueError(
                    f"{type(model).__name__}: module {path or '(root)'} ({type(module).__name__}) has meta "
                    f"{what} and no reset_parameters() to initialise them; build it on a real device or give "
                    "the module reset_parameters (or the model init_rule)"
                )
        self.pending: dict[int, str] = {}  # id(placeholder) -> name: parameters a FlatBuffer must still fill
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    # ---- values ---------------------------------------------------------------------------------------
    def fill(self, param: torch.Tensor, out: torch.Tensor, start: int = 0, name: str | None = None) -> None:
        """Write elements [start, start + out.numel()) of `param` (flattened, as this rank holds it: its tp
        slice) into `out`; `name` defaults to the placeholder's."""
        name = self.pending[id(param)] if name is None else name
        tp_slice = getattr(param, "_meshlm_tp_slice", None)
        if self.source is not None:
            self.source.fill(name, self.shapes[name], param.shape, tp_slice, start, out)
            return
        if self.rules is not None:
            fill_(out, self.rules[name], self.seed, name, self.shapes[name], param.shape, tp_slice, start)
            return
        path, _, attr = name.rpartition(".")
        full = self._module_tensors(path)[attr]
        local = full if tp_slice is None else full.narrow(tp_slice[0], tp_slice[1], param.shape[tp_slice[0]])
        out.copy_(local.reshape(-1)[start : start + out.numel()])

    def _module_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """One module's own parameters and buffers from its reset_parameters(), on a private copy (the last
        one is kept: consecutive pieces of one module materialise it once)."""
        if self._cached is None or self._cached[0] != path:
            self._cached = None  # drop the previous module before building this one
            src = self.modules[path]
            temp = copy.copy(src)
            temp._modules = {}
            temp._parameters = {
                k: None if v is None else nn.Parameter(torch.empty(v.shape, dtype=v.dtype, device="meta"))
                for k, v in src._parameters.items()
            }
            temp._buffers = {
                k: None if b is None else torch.empty(b.shape, dtype=b.dtype, device="meta")
                for k, b in src._buffers.items()
            }
            temp.to_empty(device=self.device, recurse=False)
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(block_seed(self.seed, path, 0))
                temp.reset_parameters()
            tensors = {k: v.detach() for k, v in temp._parameters.items() if v is not None}
            tensors.update({k: b for k, b in temp._buffers.items() if b is not None})
            self._cached = (path, tensors)
        return self._cached[1]

    # ---- swapping meta parameters for real ones ---------------------------------------------------------
    @torch.no_grad()
    def replace_params(
        self, model: nn.Module, chunks: list[nn.Module], packed: bool, packs_frozen: bool = False
    ) -> None:
        """Give this rank's chunks real parameters and buffers on the device. With `packed` (data parallel /
        ZeRO will lay them into flat buffers) trainable ones become placeholders, registered in `pending`,
        for the FlatBuffer to fill (frozen ones too with `packs_frozen`: ZeRO-3 shards them); the rest are
        allocated and filled here. Tags and gradient hooks (tensor
        parallelism's) move to the new Parameter; every module of `model` and `chunks` holding one sees it."""
        new: dict[int, nn.Parameter] = {}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if id(p) in new or not p.is_meta:
                    if not p.is_meta and p.device != self.device:
                        p.data = p.data.to(self.device)
                    continue
                if packed and (p.requires_grad or packs_frozen):
                    # Right shape and dtype, one element of storage: FlatBuffer re-points .data at its view.
                    one = torch.empty((), dtype=p.dtype, device=self.device)
                    q = nn.Parameter(one.expand(p.shape), p.requires_grad)
                    self.pending[id(q)] = name
                else:
                    q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device), p.requires_grad)
                    self.fill(p, q.view(-1), name=name)
                q.__dict__.update(p.__dict__)
                if p._backward_hooks:
                    q._backward_hooks = p._backward_hooks  # re-registers tensor parallelism's grad hooks
                new[id(p)] = q
        for module in {m for root in (model, *chunks) for m in root.modules()}:
            for key, p in module._parameters.items():
                if p is not None and id(p) in new:
                    module._parameters[key] = new[id(p)]
        for chunk in chunks:
            for path, module in chunk.named_modules():
                for key, b in module._buffers.items():
                    if b is not None:
                        module._buffers[key] = self._module_tensors(path)[key] if b.is_meta else b.to(self.device)
        self._cached = None

    def done(self, param: nn.Parameter) -> None:
        """A FlatBuffer has laid `param` out (and filled what this rank holds of it)."""
        self.pending.pop(id(param), None)

    def check_done(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.pending:
            raise RuntimeError(f"meta parameters left uninitialised: {sorted(self.pending.values())[:5]}")
