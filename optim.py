"""
The optimisers of the paper's recipe: Muon (Polar Express, NorMuon, cautious weight decay) for the weight
matrices inside the network, AdamW for everything else, and the step that clips and applies both.
train.py sets their learning rates and Muon's momentum each step (its schedule); this file holds what a step
does with them.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import zeros as distributed_zeros

# Polar Express coefficients (a, b, c) of the 5 iterations (Amsel et al., 2025, as the authors' train.py uses them)
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
POLAR_SAFETY = 1.02  # dividing by the Frobenius norm (>= the spectral one) puts the singular values in [0, 1];
POLAR_EPS = 1e-6  # 2% more keeps them there through bf16 rounding, and eps guards a zero matrix (both: the
#                   authors' train.py, after Amsel et al., 2025)
NORMUON_EPS = 1e-10  # ours: a row (or column) whose update is all zero is divided by this, not by 0


def polar_express(G):
    """Orthogonalise a stack of matrices (..., rows, cols) in bf16: U V^T of their SVD, approximately."""
    X = G.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * POLAR_SAFETY + POLAR_EPS)
    for a, b, c in POLAR_EXPRESS:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def moment_shape(rows, cols):
    """NorMuon's second moment of a (rows, cols) matrix: one per row if rows >= cols, else one per column."""
    return (rows, 1) if rows >= cols else (1, cols)


def normuon(o, v, beta2):
    """The update of orthogonalised matrices o (k, rows, cols), fp32: NorMuon's normalisation by the second moments
    v (k, rows, 1) or (k, 1, cols), which it updates in place, rescaled to each matrix's own norm, then the shape
    scaling. The one code path of every layout: one process, DDP, and the owners of whole matrices under FSDP."""
    rows, cols = o.shape[-2:]
    v.lerp_(o.square().mean(dim=-1 if rows >= cols else -2, keepdim=True), 1 - beta2)
    normed = o * v.clamp_min(NORMUON_EPS).rsqrt()
    norm = lambda x: x.norm(dim=(-2, -1), keepdim=True)  # of each matrix
    normed *= norm(o) / norm(normed).clamp_min(NORMUON_EPS)  # keep each orthogonalised update's norm
    normed *= max(1.0, rows / cols) ** 0.5
    return normed


def cautious_step(p, normed, lr, wd):
    """The cautious weight decay, p -= lr · wd · p only where the update already moves the weight towards zero,
    then p -= lr · normed. Elementwise, so a shard of p takes the same shard of normed."""
    p.sub_(lr * wd * (normed * p >= 0) * p)
    p.sub_(lr * normed)


class Muon(torch.optim.Optimizer):
    """Muon for the weight matrices: Nesterov momentum (EMA form), Polar Express, NorMuon second
    moment, shape scaling, cautious weight decay. The matrices of one shape are updated as one stack
    (k, rows, cols), with foreach ops for the momentum: the same ops whatever k, so that a step of the 450M
    dyn_exo layout dispatches 779 aten ops, not 4,664 (one set per matrix: tiny kernels a GPU waits to launch).
    Under DDP each rank orthogonalises only its share of every stack and all-gathers the results; the cheap
    elementwise work runs on every rank, so parameters and optimiser state stay identical everywhere (and
    checkpointable from rank 0). Under FSDP (parameters that are DTensors) see _step_sharded. The weight decay is
    lr · wd, as in the authors' train.py (modded-nanogpt scales its own by lr² instead)."""

    def __init__(self, params, lr, momentum, beta2, weight_decay, rank=0, world_size=1):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay))
        self.rank, self.world_size = rank, world_size

    def _orthogonalize(self, updates):
        """Polar Express of same-shaped matrices, as one stack (k, rows, cols), each rank doing its share."""
        share = math.ceil(len(updates) / self.world_size)
        mine = list(updates[self.rank * share:(self.rank + 1) * share])
        mine += [torch.zeros_like(updates[0])] * (share - len(mine))  # pad so all ranks gather equal sizes
        result = polar_express(torch.stack(mine))
        if self.world_size > 1:
            parts = [torch.empty_like(result) for _ in range(self.world_size)]
            dist.all_gather(parts, result)
            result = torch.cat(parts)[:len(updates)]
        return result

    @torch.no_grad()
    def step(self, closure=None):  # closure: the Optimizer API's (torch's state-dict functions pass None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and isinstance(params[0], DTensor):
                self._step_sharded(params, group)
                continue
            by_shape = {}
            for p in params:
                by_shape.setdefault(p.shape, []).append(p)
            for stack in by_shape.values():
                self._step_stack(stack, group)

    def _step_stack(self, params, group):
        """One step of same-shaped matrices; the state stays per matrix (the checkpoint format)."""
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["momentum"] = torch.zeros_like(p)
                state["second_moment"] = torch.zeros(moment_shape(*p.shape), device=p.device)
        grads, momenta = [p.grad for p in params], [s["momentum"] for s in states]
        torch._foreach_lerp_(momenta, grads, 1 - mu)
        u = self._orthogonalize(torch._foreach_lerp(grads, momenta, mu)).float()  # Nesterov
        v = torch.stack([s["second_moment"] for s in states])  # (k, rows, 1) or (k, 1, cols)
        normed = normuon(u, v, group["beta2"])
        p = torch.stack(params)
        cautious_step(p, normed, lr, wd)
        torch._foreach_copy_(params, p.unbind(0))
        torch._foreach_copy_([s["second_moment"] for s in states], v.unbind(0))

    def _step_sharded(self, params, group):
        """One step of FSDP's sharded matrices (DTensors, rows split over the ranks), equal to the unsharded one
        (orthogonalising each shard alone would not be). The momentum runs on this rank's shards; one all-to-all
        brings each matrix's owner (assign_owners) the shards of its Nesterov update and second moment; the owner
        runs the unsharded update on its whole matrices, stacked by shape (polar_express, normuon); a second
        all-to-all returns each rank its rows of the result, which it applies to its rows of the weights.
        The states are DTensors sharded like their parameters, so that DCP reshards them."""
        mesh, mu = params[0].device_mesh, group["momentum"]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["momentum"] = torch.zeros_like(p)
                state["second_moment"] = distributed_zeros(moment_shape(*p.shape), device_mesh=mesh,
                                                           placements=[Shard(0)])
        grads, momenta = [p.grad.to_local() for p in params], [s["momentum"].to_local() for s in states]
        torch._foreach_lerp_(momenta, grads, 1 - mu)
        moments = [s["second_moment"].to_local() for s in states]
        shapes = [[tuple(p.shape), moment_shape(*p.shape)] for p in params]
        owners = assign_owners([s for s, _ in shapes], mesh.size())
        exchange = Exchange(shapes, owners, mesh.get_local_rank(), mesh.size(), mesh.get_group(),
                            grads[0].device)
        whole = exchange.to_owners(list(zip(torch._foreach_lerp(grads, momenta, mu), moments)))  # Nesterov
        results = {}
        for idx in by_shape(whole, shapes):
            v = torch.stack([whole[i][1] for i in idx])
            normed = normuon(polar_express(torch.stack([whole[i][0] for i in idx])).float(), v, group["beta2"])
            results.update({i: (normed[j], v[j]) for j, i in enumerate(idx)})
        mine = exchange.from_owners(results)  # this rank's rows of every matrix's (update, second moment)
        for idx in by_shape(range(len(params)), shapes):
            p = torch.stack([params[i].to_local() for i in idx])
            cautious_step(p, torch.stack([mine[i][0] for i in idx]), group["lr"], group["weight_decay"])
            torch._foreach_copy_([params[i].to_local() for i in idx], p.unbind(0))
            torch._foreach_copy_([moments[i] for i in idx], [mine[i][1] for i in idx])


# ----------------------------------------------------------------------------- Muon under FSDP: whole matrices

def chunk_rows(n, world):
    """The rows of each rank's shard of n rows, as FSDP and DTensor's Shard(0) split them: torch.chunk's chunks of
    ceil(n / world) rows, then empty ones."""
    size = -(-n // world)
    return [max(0, min(size, n - r * size)) for r in range(world)]


def assign_owners(shapes, world):
    """The rank that orthogonalises each matrix, balanced by cost: the costliest first, each to the rank with the
    least so far (Polar Express on m x n, m <= n: ~2m²n + m³ multiply-adds an iteration; the all-to-all bytes
    follow m·n, in the same order). The same answer on every rank."""
    cost = [min(s) ** 2 * (2 * max(s) + min(s)) for s in shapes]
    load, owners = [0] * world, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -cost[i]):
        owners[i] = min(range(world), key=lambda r: load[r])
        load[owners[i]] += cost[i]
    return owners


def by_shape(indices, shapes):
    """The indices grouped by their matrix's shape, in order: one stack each."""
    groups = {}
    for i in indices:
        groups.setdefault(shapes[i][0], []).append(i)
    return groups.values()


class Exchange:
    """The two all-to-alls of a sharded Muon step. Matrix i is k tensors of shapes[i] (its update and its second
    moment), each sharded by rows over the ranks (chunk_rows); owners[i] is the rank that gets it whole."""

    def __init__(self, shapes, owners, rank, world, group, device):
        self.shapes, self.owners, self.rank, self.world, self.group, self.device = \
            shapes, owners, rank, world, group, device
        self.mine = [i for i, owner in enumerate(owners) if owner == rank]
        self.k = len(shapes[0])

    def _shard_shapes(self, i, r):
        """Rank r's shards of the tensors of matrix i."""
        return [(chunk_rows(s[0], self.world)[r], *s[1:]) for s in self.shapes[i]]

    def _swap(self, outgoing, incoming):
        """One all_to_all_single: outgoing[r], the tensors for rank r; incoming[r], the shapes of those rank r
        sends here. Returns what each rank sent, shaped."""
        out_sizes = [sum(t.numel() for t in ts) for ts in outgoing]
        send = torch.cat([t.reshape(-1) for ts in outgoing for t in ts] or [torch.zeros(0, device=self.device)])
        in_sizes = [sum(math.prod(s) for s in shapes) for shapes in incoming]
        received = send.new_empty(sum(in_sizes)) if self.world > 1 else send  # one rank: it sends to itself
        if self.world > 1:
            dist.all_to_all_single(received, send, in_sizes, out_sizes, group=self.group)
        return [[t.view(s) for t, s in zip(part.split([math.prod(s) for s in shapes]), shapes)]
                for part, shapes in zip(received.split(in_sizes), incoming)]

    def to_owners(self, parts):
        """parts[i]: this rank's shards of matrix i's tensors. Returns {i: its whole tensors} of the matrices this
        rank owns, every rank's rows in rank order."""
        outgoing = [[t for i, o in enumerate(self.owners) if o == r for t in parts[i]] for r in range(self.world)]
        incoming = [[s for i in self.mine for s in self._shard_shapes(i, r)] for r in range(self.world)]
        received = self._swap(outgoing, incoming)
        return {i: [torch.cat([received[r][n * self.k + j] for r in range(self.world)]) for j in range(self.k)]
                for n, i in enumerate(self.mine)}

    def from_owners(self, results):
        """results: {i: whole tensors} of the matrices this rank owns. Returns this rank's rows of every matrix's
        tensors, [[tensors] for each i], each from its owner."""
        pieces = {i: [t.split(chunk_rows(t.shape[0], self.world)) for t in results[i]] for i in self.mine}
        outgoing = [[parts[r] for i in self.mine for parts in pieces[i]] for r in range(self.world)]
        incoming = [[s for i, o in enumerate(self.owners) if o == r for s in self._shard_shapes(i, self.rank)]
                    for r in range(self.world)]
        received, seen = self._swap(outgoing, incoming), [0] * self.world
        mine = []
        for owner in self.owners:  # each owner's matrices arrive in index order
            mine.append(received[owner][seen[owner]:seen[owner] + self.k])
            seen[owner] += self.k
        return mine


def muon_params(model):
    """The trained weights of the nn.Linear layers inside the network: every one but lm_head's."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head}
    return [p for p in model.parameters() if id(p) in linear and p.requires_grad]  # a shared tensor is listed once


def configure_optimizers(model, cfg, rank=0, world_size=1):
    """Muon for the weights of the nn.Linear layers inside the network (blocks, anchor_proj, dynamic MLPs):
    maps from one hidden vector to another, which is what Muon's orthogonalised update suits. AdamW for
    everything else: the embedding, lm_head (its output is the vocabulary, not a hidden vector), norm
    weights, biases, λ, and any parameter a fork adds outside nn.Linear, whatever its shape. A frozen
    parameter (requires_grad=False: anchor_frozen) is in neither. cfg: train.py's TrainConfig (its keys)."""
    muon = muon_params(model)
    adam = [p for p in model.parameters() if id(p) not in set(map(id, muon)) and p.requires_grad]
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    return [Muon(muon, cfg.muon_lr, cfg.muon_momentum, cfg.muon_beta2, cfg.muon_weight_decay, rank, world_size),
            torch.optim.AdamW(adam, lr=cfg.adam_lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                              weight_decay=cfg.adam_weight_decay, **fused)]


def describe_optimizers(optimizers, model=None):
    """One line: how many tensors and parameters each optimiser updates, and which ones none does (frozen)."""
    def count(opt):
        params = [p for g in opt.param_groups for p in g["params"]]
        return f"{type(opt).__name__} {len(params)} tensors ({sum(p.numel() for p in params):,} parameters)"
    frozen = [(n, p.numel()) for n, p in model.named_parameters() if not p.requires_grad] if model else []
    return "optimisers: " + ", ".join(count(opt) for opt in optimizers) + "".join(
        f"; frozen at its random initialisation (no gradient, in no optimiser): {n} ({k:,} parameters)"
        for n, k in frozen)


def step_optimizers(model, optimizers, grad_clip):
    """Clip the global gradient norm, step both optimisers, clear the gradients; return the norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # FSDP: from the shards, a DTensor
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).item()
