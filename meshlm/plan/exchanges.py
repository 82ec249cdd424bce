"""Context- and expert-parallel exchanges of one layer for one micro-batch, as meshlm's runtime (and, for
experts, Megatron's dispatcher) runs them: blocking, except the ring's hops, which overlap its block kernels.
Formulas and sources: docs/planner.md."""

from __future__ import annotations

from meshlm.model.config import ModelConfig
from meshlm.plan.hardware import Hardware
from meshlm.plan.memory import Candidate, Dispatcher
from meshlm.plan.network import collective_time, crosses_nodes, group_time, rails
from meshlm.plan.pipeline_split import Runtime

# Of a flash kernel's forward + backward, the forward's share: its backward runs 2.5× the forward's FLOPs
# (flash-attention's own count, step_time.CAUSAL_FLASH_WORK)
FLASH_FORWARD_SHARE = 1 / 3.5


def cp_layer_time(
    model: ModelConfig, tokens: float, s: Candidate, hw: Hardware, act: int, core_s: float = 0.0
) -> float:
    """Context-parallel communication of one layer for one micro-batch of `tokens` local tokens left exposed,
    as meshlm.parallel.cp.attention runs it. Ring: forward passes the K/V block cp − 1 hops, each posted
    before the block in hand goes through the kernel and waited after it, so a hop costs only what outlasts
    one block's kernel; backward passes the K/V block cp − 1 hops again the same way and its fp32 (or wider)
    gradient cp hops, each posted after its block's kernel and waited after the next block's (beside that
    block's K/V hop), the last one (home) waited at once. `core_s`: the layer's attention-core seconds
    (forward + backward) on this rank, split evenly over the cp blocks (the load-balanced layout gives each
    the same visible work); 0 prices every hop exposed. Ulysses: q, k, v and the output all-to-all'd forward,
    their gradients backward, blocking. Full recompute repeats the forward's."""
    if s.cp == 1:
        return 0.0
    link = hw.link("cp", crosses_nodes(s.mesh, "cp", hw.gpus_per_node), "send_recv")
    kv = max(model.n_kv_heads // s.tp, 1) * model.head_dim
    forwards = 2 if s.recompute == "full" else 1
    if s.cp_attention == "ring":
        block = 2 * tokens * kv
        hop, grad_hop = (
            collective_time("send_recv", block * act, 2, link),
            collective_time("send_recv", block * max(act, 4), 2, link),
        )
        fwd, bwd = core_s / s.cp * FLASH_FORWARD_SHARE, core_s / s.cp * (1 - FLASH_FORWARD_SHARE)
        forward = (s.cp - 1) * max(0.0, hop - fwd)
        # backward steps: the first overlaps a K/V hop, the middle ones a K/V and a gradient hop, the last a
        # gradient hop; then the gradient's hop home
        backward = max(0.0, hop - bwd) + (s.cp - 2) * max(0.0, hop + grad_hop - bwd) + max(0.0, grad_hop - bwd)
        return forwards * forward + backward + grad_hop
    link = hw.link("cp", crosses_nodes(s.mesh, "cp", hw.gpus_per_node), "all_to_all")
    nbytes = 2 * tokens * (model.dim / s.tp + kv) * act  # q and output, k and v
    return (forwards + 1) * collective_time("all_to_all", nbytes, s.cp, link)


def ep_layer_time(
    model: ModelConfig,
    tokens: float,
    s: Candidate,
    hw: Hardware,
    act: int,
    runtime: Runtime = "meshlm",
    dispatcher: Dispatcher = "alltoall",
    rows: float = 1.0,
) -> float:
    """Expert-parallel communication of one MoE layer for one micro-batch of `tokens` local tokens, blocking,
    not overlapped, 4 exchanges (dispatch and combine forward, again reversed in backward), 6 with full or
    'mlp' recompute (both rerun the routed MLP). `rows`: the routed rows a rank sends over the k·tokens of
    balanced dropless routing (`Assumptions.moe_rows`: a capacity factor drops or pads them).

    All-to-all: the rows-per-expert counts (E int64, once per forward), then the k rows of each token (h wide
    each); balanced routing sends (ep − 1)/ep of them off the rank, which `collective_time`'s all-to-all
    charges. meshlm's runtime (meshlm.parallel.tp.moe) exchanges the whole (under sequence parallelism,
    all-gathered) sequence from every tp rank; Megatron's all-to-all dispatcher under sequence parallelism
    sends each tp rank's tokens/tp and then all-gathers the received rows over tp (reduce-scatters them back
    at the combine): k·tokens rows where the dense MLP's gather moves tokens, so (k·rows − 1)·tokens rows
    more than the tensor-parallel term already counts.

    All-gather (Megatron's `--moe-token-dispatcher-type allgather`, megatron runtime only): every rank
    gathers the hidden states of its tp·ep group (s/tp·b rows from each) with their routing probabilities
    (fp32) and map (bool), E each a token, computes its own experts' rows and reduce-scatters the outputs
    back. The tp part of that gather is the dense MLP's, already in the tensor-parallel term; the ep part
    gathers the `tokens` of each of ep ranks: (ep − 1)·tokens·h received, against the all-to-all's
    (ep − 1)/ep·k·tokens·h sent, so it moves ep/k times the all-to-all's bytes, whatever the capacity."""
    if s.ep == 1:
        return 0.0
    forwards = 2 if s.recompute in ("full", "mlp") else 1
    if dispatcher == "allgather":
        cross = crosses_nodes(s.mesh, "ep", hw.gpus_per_node)
        per_node = rails(s.mesh, "ep", hw.gpus_per_node) if cross else s.ep
        hidden = s.ep * tokens * model.dim * act
        pair = sum(group_time(hw, "ep", cross, op, hidden, s.ep, per_node) for op in ("all_gather", "reduce_scatter"))
        routing = group_time(hw, "ep", cross, "all_gather", s.ep * tokens * model.n_experts * 5, s.ep, per_node)
        return (forwards + 1) * pair + forwards * routing
    link = hw.link("ep", crosses_nodes(s.mesh, "ep", hw.gpus_per_node), "all_to_all")
    split = runtime == "megatron" and s.sequence_parallel and s.tp > 1
    sent = tokens / s.tp if split else tokens
    sent_rows = collective_time("all_to_all", sent * rows * model.top_k * model.dim * act, s.ep, link)
    counts = collective_time("all_to_all", 8 * model.n_experts, s.ep, link)
    regather = 0.0
    if split:
        nbytes = max(model.top_k * rows - 1, 0.0) * tokens * model.dim * act
        tp_cross = crosses_nodes(s.mesh, "tp", hw.gpus_per_node)
        regather = sum(
            group_time(hw, "tp", tp_cross, op, nbytes, s.tp, s.tp) for op in ("all_gather", "reduce_scatter")
        )
    return (forwards + 1) * (2 * sent_rows + regather) + forwards * counts
