"""Set-up of a model built on the `meta` device: each rank allocates and initialises only what it keeps.

The engine applies tensor and pipeline parallelism to the meta model (slices of meta tensors are meta, their
Shards recorded in the build's placement table, meshlm.parallel.placement), then
`MetaInit.replace_params` swaps every meta parameter of this rank's chunks for a real one on the device:
allocated and filled at once when the rank keeps it whole, or a storage-less placeholder when data
parallelism / ZeRO will pack it, whose FlatBuffer then fills only what the rank holds
(ZeRO-3: its flat shard, nothing else ever allocated).

Values come from the first of these the model offers (the init protocol, docs/api.md); under every layout
each rank gets its slices of exactly the tensors the protocol gives the whole model in one process:
  * `init_source` (meshlm.model.pretrained.HFWeights, given to meshlm's Transformer by `model.init_from`):
    each rank's region read from a checkpoint's files, nothing else read;
  * `init_rule(name, param)` -> meshlm.Normal(std) | meshlm.Constant(value), with `init_seed` (meshlm's
    Transformer): every element from meshlm.model.init, a function of (seed, name, index), so nothing beyond
    the rank's shard is ever generated. Set-up memory: the shard;
  * `init_weights()` on the model (torchtitan's protocol; Hugging Face models have it too): run once on a
    private whole copy of the model, materialised on the CPU, under `torch.manual_seed(seed)`, and sliced.
    The reference is exactly `model.to_empty(device="cpu"); torch.manual_seed(seed); model.init_weights()`
    (with tied parameters kept tied, which to_empty does not do).
    Set-up memory: the whole model (in its dtype) in host memory, per rank, until materialisation ends;
  * otherwise each module's `reset_parameters()`, run on a private copy of that one module (materialised
    with `to_empty`) under `torch.manual_seed(block_seed(seed, module name, 0))`, and sliced: one module at
    a time in memory. Every layout equals the one-process (world 1) meta build; a model built whole draws
    all modules from one RNG stream instead, so give such a model init_weights() to be reproduced.
A meta module that none of these initialises is refused in one line (InitError) before anything changes.
`seed` is the model's `init_seed`, else torch.initial_seed() as global rank 0 has it.
"""

from __future__ import annotations

import ast
import copy
import inspect
import math
import textwrap
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshlm.errors import InputError
from meshlm.model.init import InitRule, TensorSlice, block_seed, fill_
from meshlm.parallel.placement import Placements, Shard
from meshlm.ties import tied_aliases


class InitError(InputError):
    """A meta-built model meshlm cannot initialise, phrased as one line naming the module."""


def _check_no_init_in_constructor(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """A meta parameter that meshlm will fill from its module's reset_parameters() must not have been written
    in place more often than reset_parameters() writes it: the extra writes are an init in the model's
    `__init__` (nn.init.normal_, nanoGPT's self.apply(self._init_weights)), a no-op on meta that the eager
    build does run. Each in-place op bumps a tensor's version counter, meta tensors included, so the count is
    exact: a private meta copy of the module runs reset_parameters() and its parameters' versions are the
    bound. Such a model is refused in one line (InitError) rather than started from other weights."""
    for path, module in modules.items():
        own = {k: p for k, p in module._parameters.items() if p is not None and p.is_meta}
        if not own or not callable(getattr(module, "reset_parameters", None)):
            continue
        temp = copy.copy(module)
        temp._modules = {}
        temp._parameters = {
            k: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"))
            for k, p in module._parameters.items()
        }
        temp._buffers = {
            k: None if b is None else torch.empty_like(b, device="meta") for k, b in module._buffers.items()
        }
        with torch.no_grad():
            temp.reset_parameters()
        for key, p in own.items():
            extra = p._version - temp._parameters[key]._version
            name = f"{path}.{key}" if path else key
            if extra < 0:
                raise InitError(
                    f"{type(model).__name__}: parameter {name} was not written by its module's reset_parameters() "
                    f"while built on meta ({type(module).__name__}'s reset_parameters() writes it {-extra} more "
                    "time(s): a new nn.Parameter assigned in __init__, or a module whose __init__ does not call "
                    "reset_parameters()): the eager build keeps what __init__ gave it and meshlm cannot replay that; "
                    "move that init into an init_weights() method (docs/api.md), or build the model on a real device"
                )
            if extra > 0:
                raise InitError(
                    f"{type(model).__name__}: parameter {name} was written in place {extra} more time(s) than its "
                    f"module's reset_parameters() writes it while built on meta (an init in __init__, e.g. "
                    "nn.init.normal_ or self.apply(...)): it draws nothing there and meshlm cannot replay it; move "
                    "that init into an init_weights() method (docs/api.md), or build the model on a real device"
                )


def _check_no_data_writes(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """A write through `.data` in a module's `__init__` (`p.data.normal_()`, `p.data = ...`, `init.normal_(p.data)`)
    leaves no trace on a meta tensor (a `.data` tensor has a version counter of its own), so it is found in the
    source: `__init__` of each class of the model outside torch, and the methods it calls on `self`
    (`reset_parameters()` excepted: meshlm replays it). Refused in one line naming the module and the line."""
    seen: set[type] = set()
    for path, module in modules.items():
        cls = type(module)
        if cls in seen:
            continue
        seen.add(cls)
        found = _data_write_in_init(cls)
        if found is not None:
            where, line, text = found
            raise InitError(
                f"{type(model).__name__}: module {path or '(root)'} ({cls.__name__}): {where} writes a tensor's .data "
                f"in place (line {line}: {text}): built on meta it draws nothing and leaves no trace meshlm could "
                "replay; move that init into an init_weights() method (docs/api.md), or build the model on a real "
                "device"
            )


def _data_write_in_init(cls: type) -> tuple[str, int, str] | None:
    """(function, line, source) of the first `.data` write reachable from `cls.__init__` through calls on self."""
    todo, done = ["__init__"], set()
    while todo:
        name = todo.pop(0)
        func = getattr(cls, name, None)
        done.add(name)
        if not inspect.isfunction(func) or func.__module__.startswith("torch."):
            continue
        try:
            lines, first = inspect.getsourcelines(func)
        except (OSError, TypeError):
            continue
        tree = ast.parse(textwrap.dedent("".join(lines)))
        for node in ast.walk(tree):
            if _writes_data(node):
                return func.__qualname__, first + node.lineno - 1, ast.unparse(node)[:80]
            called = node.attr if isinstance(node, ast.Attribute) and _is_self(node.value) else None
            if called and called != "reset_parameters" and called not in done and called not in todo:
                todo.append(called)
    return None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_data(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "data"


def _writes_data(node: ast.AST) -> bool:
    """`x.data.op_(...)`, `op_(..., x.data, ...)`, `x.data = ...`, `x.data[...] = ...`, `x.data += ...`."""
    if isinstance(node, ast.Call):
        func = node.func
        in_place = isinstance(func, (ast.Attribute, ast.Name)) and getattr(func, "attr", getattr(func, "id", ""))
        if not (isinstance(in_place, str) and in_place.endswith("_") and not in_place.endswith("__")):
            return False
        return (isinstance(func, ast.Attribute) and _is_data(func.value)) or any(_is_data(a) for a in node.args)
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(_is_data(t) or (isinstance(t, ast.Subscript) and _is_data(t.value)) for t in targets)
    return False


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
    initialise its meta tensors is named in a one-line InitError. `placements` is the build's table, which
    says where each sliced parameter sits in the full one."""

    def __init__(self, model: nn.Module, device: torch.device, placements: Placements | None = None) -> None:
        self.device = device
        self.placements = Placements() if placements is None else placements
        self.seed = agreed_seed(getattr(model, "init_seed", None))
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        # A tied weight seen under an alias (a pipeline's last stage holds the head, not the embedding) is
        # drawn under its canonical name, so every copy of it starts equal.
        self.aliases = tied_aliases(model)
        self.source = getattr(model, "init_source", None)
        rule: Callable[[str, torch.Tensor], InitRule] | None = getattr(model, "init_rule", None)
        self.rules = {name: rule(name, p) for name, p in model.named_parameters()} if callable(rule) else None
        own = self.rules is None and self.source is None  # parameters only the model's code can initialise
        # init_weights() runs on a whole copy, taken now while the model is unsharded meta (no memory).
        self.whole_model = copy.deepcopy(model) if own and callable(getattr(model, "init_weights", None)) else None
        self.modules = dict(model.named_modules())
        for path, module in self.modules.items():
            meta_params = own and any(p.is_meta for p in module.parameters(recurse=False))
            meta_buffers = any(b.is_meta for b in module.buffers(recurse=False))
            by_module = callable(getattr(module, "reset_parameters", None))
            if (meta_params or meta_buffers) and self.whole_model is None and not by_module:
                what = "parameters" if meta_params else "buffers"
                raise InitError(
                    f"{type(model).__name__}: module {path or '(root)'} ({type(module).__name__}) has meta {what} "
                    "and nothing initialises them; give the model an init_weights() method (run once on the "
                    "materialised model, docs/api.md) or the module reset_parameters(), or build it on a real device"
                )
        if own and self.whole_model is None:
            _check_no_data_writes(model, self.modules)
            _check_no_init_in_constructor(model, self.modules)
        self.pending: dict[int, str] = {}  # id(placeholder) -> name: parameters a FlatBuffer must still fill
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None
        self._whole: dict[str, torch.Tensor] | None = None

    # ---- values ---------------------------------------------------------------------------------------
    def fill(self, param: torch.Tensor, out: torch.Tensor, start: int = 0, name: str | None = None) -> None:
        """Write elements [start, start + out.numel()) of `param` (flattened, as this rank holds it: its tp
        shard) into `out`; `name` defaults to the placeholder's."""
        name = self.pending[id(param)] if name is None else name
        name = self.aliases.get(name, name)
        shards = self.placements[param].shards  # one per mesh dim that cuts it (ep: dim 0 of stacked experts; tp)
        if self.source is not None or self.rules is not None:
            for tp_slice, shape, first, part in _flat_runs(shards, param.shape, start, out):
                if self.source is not None:
                    self.source.fill(name, self.shapes[name], shape, tp_slice, first, part)
                else:
                    fill_(part, self.rules[name], self.seed, name, self.shapes[name], shape, tp_slice, first)
            return
        if self.whole_model is not None:
            full = self._whole_tensors()[name]
        else:
            path, _, attr = name.rpartition(".")
            full = self._module_tensors(path)[attr]
        for shard in shards:
            full = torch.cat(
                [full.narrow(shard.dim, f, n) for _, f, n in shard.runs(0, param.shape[shard.dim])], shard.dim
            )
        out.copy_(full.reshape(-1)[start : start + out.numel()])

    def _whole_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the model after its init_weights(), on the CPU (computed once)."""
        if self._whole is None:
            whole = self.whole_model
            _empty_on_cpu(whole)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(self.seed)
                whole.init_weights()
            self._whole = {n: p.detach() for n, p in whole.named_parameters(remove_duplicate=False)}
            self._whole.update(dict(whole.named_buffers(remove_duplicate=False)))
        return self._whole

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

    def _buffer(self, path: str, key: str) -> torch.Tensor:
        if self.whole_model is not None:
            return self._whole_tensors()[f"{path}.{key}" if path else key]
        return self._module_tensors(path)[key]

    # ---- swapping meta parameters for real ones ---------------------------------------------------------
    @torch.no_grad()
    def replace_params(
        self, model: nn.Module, chunks: list[nn.Module], packed: bool, packs_frozen: bool = False
    ) -> None:
        """Give this rank's chunks real parameters and buffers on the device. With `packed` (data parallel /
        ZeRO will lay them into flat buffers) trainable ones become placeholders, registered in `pending`,
        for the FlatBuffer to fill (frozen ones too with `packs_frozen`: ZeRO-3 shards them); the rest are
        allocated and filled here. Placement records and gradient hooks (tensor
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
                self.placements.move(p, q)
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
                        module._buffers[key] = (
                            self._buffer(path, key).to(self.device) if b.is_meta else b.to(self.device)
                        )
        self._cached = None

    def done(self, param: nn.Parameter) -> None:
        """A FlatBuffer has laid `param` out (and filled what this rank holds of it)."""
        self.pending.pop(id(param), None)

    def check_done(self) -> None:
        if self.source is not None:
            self.source.close()
        self.whole_model = self._whole = None  # the whole copy lives only through set-up
        if self.pending:
            raise RuntimeError(f"meta parameters left uninitialised: {sorted(self.pending.values())[:5]}")


def _flat_runs(
    shards: tuple[Shard, ...], local_shape: torch.Size, start: int, out: torch.Tensor
) -> list[tuple[TensorSlice | None, tuple[int, ...], int, torch.Tensor]]:
    """Elements [start, start + out.numel()) of a tp-local tensor as pieces of contiguous slices of the full
    tensor: (tp_slice (dim, full offset), or one such pair per dim for an expert weight sliced over ep and tp,
    or None; the slice's shape, the first element within it, its part of `out`). One piece unless the shard
    is several runs (a fused projection's blocks, always along dim 0)."""
    if not shards:
        return [(None, tuple(local_shape), start, out)]
    if len(shards) > 1:  # ep × tp: contiguous along each dim (experts, hidden units)
        return [(tuple((s.dim, s.pieces[0][0]) for s in shards), tuple(local_shape), start, out)]
    (shard,) = shards
    if shard.contiguous:
        return [((shard.dim, shard.pieces[0][0]), tuple(local_shape), start, out)]
    row = math.prod(local_shape[1:])
    end, pieces = start + out.numel(), []
    for local, full, length in shard.runs(0, local_shape[0]):
        lo, hi = max(start, local * row), min(end, (local + length) * row)
        if lo < hi:
            pieces.append(((0, full), (length, *local_shape[1:]), lo - local * row, out[lo - start : hi - start]))
    return pieces


def _empty_on_cpu(model: nn.Module) -> None:
    """`model.to_empty(device="cpu")` that keeps tied parameters tied (to_empty gives each holder its own)."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                module._parameters[key] = new[id(p)]
        for key, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[key] = torch.empty_like(b, device="cpu")
