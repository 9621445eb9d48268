"""
The optimisers of the paper's recipe: Muon (Nesterov momentum, Polar Express, NorMuon, cautious weight decay) for the
weight matrices inside the network (muon_params), AdamW for everything else. train.py builds them by name
(build_optimizers: an Optimizers), sets their learning rates and Muon's momentum (its schedule), clips the gradients
(clip_gradients) and steps them; Muon.update is what a step does with a stack of matrices, in the paper's order.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from engine import sharding

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


class Muon(torch.optim.Optimizer):
    """Muon for the weight matrices. The matrices of one shape are updated as one stack (k, rows, cols), with foreach
    ops for the momentum: the same ops whatever k, so that a step of the 450M dyn_exo layout dispatches 774 aten ops,
    not 4,664 (one set per matrix: tiny kernels a GPU waits to launch). The state stays per matrix (the checkpoint
    format). Under DDP each rank orthogonalises only its share of every stack and all-gathers the results; the cheap
    elementwise work runs on every rank, so parameters and optimiser state stay identical everywhere (and
    checkpointable from rank 0). Under FSDP each matrix's owner runs steps 2 and 3 on it whole (sharding.Exchange).
    The weight decay is lr · wd, as in the authors' train.py (modded-nanogpt scales its own by lr² instead)."""

    def __init__(self, params, lr, momentum, beta2, weight_decay, rank=None, world_size=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay))
        # DDP's: each rank orthogonalises a share of every stack (None: this process's place in its process group);
        # a sharded model's owners hold whole matrices, and one process has no share to take
        sharded = any(sharding.is_sharded(p) for g in self.param_groups for p in g["params"])
        ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() and not sharded else (0, 1)
        self.rank, self.world_size = ranks[0] if rank is None else rank, ranks[1] if world_size is None else world_size

    @torch.no_grad()
    def step(self, closure=None):  # closure: the Optimizer API's (torch's state-dict functions pass None)
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(p.shape, []).append(p)
            stacks = list(by_shape.values())
            # under FSDP all stacks together, so that one all-to-all each way carries every matrix; else one stack at
            # a time, its temporaries freed before the next
            for batch in [stacks] if stacks and sharding.is_sharded(stacks[0][0]) else [[s] for s in stacks]:
                self.update(batch, group)

    def update(self, stacks, group):
        """Muon's update of stacks of same-shaped matrices (each a list of parameters), its four steps in order."""
        lr, mu, beta2, wd = group["lr"], group["momentum"], group["beta2"], group["weight_decay"]
        states = [[self._state(p) for p in params] for params in stacks]
        moments = [sharding.local([s["second_moment"] for s in stack]) for stack in states]
        # 1. Nesterov momentum, as an EMA: m <- μ·m + (1-μ)·g, and the update g + μ·(m - g) looks one step further
        #    along it. Elementwise, so under FSDP each rank runs it on its own rows.
        updates = []
        for params, stack in zip(stacks, states):
            grads, momenta = sharding.local([p.grad for p in params]), sharding.local([s["momentum"] for s in stack])
            torch._foreach_lerp_(momenta, grads, 1 - mu)
            updates.append(torch._foreach_lerp(grads, momenta, mu))
        # Steps 2 and 3 take whole matrices, each stack as one tensor (k, rows, cols): here all of them; under FSDP the
        # ones this rank owns, their rows gathered from every rank, and the results sent back after step 3
        exchange = sharding.Exchange(stacks, [[s["second_moment"] for s in stack] for stack in states]) \
            if sharding.is_sharded(stacks[0][0]) else Unsharded
        whole = exchange.to_owners(updates, moments)
        for w in whole:
            # 2. Polar Express: the nearest orthogonal matrix, U Vᵀ of the update's SVD, approximately, in bf16
            o = self._gather(polar_express(self._share(w[0])), len(w[0])).float()
            # 3. NorMuon: each row (or column) divided by the RMS of its history (the second moment w[1], updated in
            #    place), rescaled to the orthogonalised update's norm, then the shape scaling
            w[0] = normuon(o, w[1], beta2)
        # 4. Cautious weight decay and the step: p -= lr·wd·p only where the update moves p towards 0, then
        #    p -= lr·update. Elementwise: under FSDP each rank on its own rows.
        for params, (normed, v), moment in zip(stacks, exchange.from_owners(whole), moments):
            p = torch.stack(sharding.local(params))
            p.sub_(lr * wd * (normed * p >= 0) * p)
            p.sub_(lr * normed)
            torch._foreach_copy_(sharding.local(params), p.unbind(0))
            torch._foreach_copy_(moment, v.unbind(0))

    def _state(self, p):
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(p)
            state["second_moment"] = sharding.zeros(moment_shape(*p.shape), like=p)  # sharded like p under FSDP
        return state

    def _share(self, stack):
        """This rank's share of a stack of matrices (k, rows, cols) under DDP, padded with zero matrices so that every
        rank's is the same size; the whole stack in one process (and under FSDP, whose owners hold whole stacks)."""
        if self.world_size == 1:
            return stack
        share = math.ceil(len(stack) / self.world_size)
        mine = stack[self.rank * share:(self.rank + 1) * share]
        return torch.cat([mine, mine.new_zeros(share - len(mine), *mine.shape[1:])]) if len(mine) < share else mine

    def _gather(self, share, k):
        """Every rank's share of a stack of k matrices (DDP), back as the whole stack."""
        if self.world_size == 1:
            return share
        parts = [torch.empty_like(share) for _ in range(self.world_size)]
        dist.all_gather(parts, share)
        return torch.cat(parts)[:k]


class Unsharded:
    """Where steps 2 and 3 find whole matrices when every rank holds them (one process, DDP): each stack as one
    tensor, here. (sharding.Exchange is FSDP's, with the same two methods.)"""

    @staticmethod
    def to_owners(updates, moments):
        return [[torch.stack(u), torch.stack(v)] for u, v in zip(updates, moments)]

    @staticmethod
    def from_owners(whole):
        return whole


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
    scaling."""
    rows, cols = o.shape[-2:]
    v.lerp_(o.square().mean(dim=-1 if rows >= cols else -2, keepdim=True), 1 - beta2)
    normed = o * v.clamp_min(NORMUON_EPS).rsqrt()
    norm = lambda x: x.norm(dim=(-2, -1), keepdim=True)  # of each matrix
    normed *= norm(o) / norm(normed).clamp_min(NORMUON_EPS)  # keep each orthogonalised update's norm
    normed *= max(1.0, rows / cols) ** 0.5
    return normed


# ----------------------------------------------------------------------------- which parameter goes where

def muon_params(model):
    """The trained weights of the nn.Linear layers inside the network: every one but lm_head's."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head}
    return [p for p in model.parameters() if id(p) in linear and p.requires_grad]  # a shared tensor is listed once


class Optimizers(dict):
    """A run's optimisers by name ({"muon": Muon, "adam": AdamW} in the recipe; a fork adds any torch.optim.Optimizer)
    as one resumable part: its state is each optimiser's under its name, never paired by position."""

    def state_dict(self):
        return {name: opt.state_dict() for name, opt in self.items()}

    def load_state_dict(self, states):
        for name, state in self.named(states).items():
            try:
                self[name].load_state_dict(state)
            except (ValueError, KeyError) as e:  # torch's own: a group of another size, say
                raise ValueError(f"optimiser {name!r}: its saved state does not fit ({e})") from None

    def set_schedule(self, scheduled):
        """Each <name>_<key> of train.schedule()'s values into every param group of the optimiser of that name (each
        needs its <name>_lr: a learning rate the config sets, never one left in a group by a loaded state). Returns
        the learning rates, <name>_lr, for the log."""
        for name, opt in self.items():
            if f"{name}_lr" not in scheduled:
                raise ValueError(f"the schedule has no {name}_lr for the optimiser {name!r}")
            for key in [k for k in scheduled if k.startswith(f"{name}_")]:
                for group in opt.param_groups:
                    group[key.removeprefix(f"{name}_")] = scheduled[key]
        return {f"{name}_lr": scheduled[f"{name}_lr"] for name in self}

    def check_params(self, model):
        """Each trained parameter of model in exactly one of these optimisers: one in two would be updated twice a
        step, one in none never, and neither fails by itself. A one-line error naming the first such parameter."""
        holders = {}
        for name, opt in self.items():
            for p in {id(p): p for g in opt.param_groups for p in g["params"]}.values():
                holders.setdefault(id(p), []).append(name)
        for pname, p in model.named_parameters():
            where = holders.get(id(p), [])
            if len(where) > 1:
                raise ValueError(f"parameter {pname} is in {len(where)} optimisers, {' and '.join(where)}: each "
                                 f"trained parameter belongs to exactly one (train.build_optimizers)")
            if not where and p.requires_grad:
                raise ValueError(f"parameter {pname} is trained but in no optimiser ({', '.join(self)}): each trained "
                                 f"parameter belongs to exactly one (train.build_optimizers)")

    def named(self, states):
        """Saved states by name, checked against these optimisers' names: a missing, extra or renamed one is a
        one-line error. A list (written before optimisers had names: [Muon's, AdamW's]) takes these names in their
        order, or, where the groups' parameter counts tell otherwise, the one optimiser whose counts it has."""
        if isinstance(states, list):
            counts = lambda groups: [len(g["params"]) for g in groups]
            mine = {name: counts(opt.param_groups) for name, opt in self.items()}
            by_count = [[n for n, c in mine.items() if c == counts(s["param_groups"])] for s in states]
            if all(len(n) == 1 for n in by_count) and len({n[0] for n in by_count}) == len(states):
                states = {n[0]: s for n, s in zip(by_count, states)}
            elif len(states) == len(self):
                states = dict(zip(self, states))
            else:
                raise ValueError(f"{len(states)} optimisers in the checkpoint, {len(self)} in this run: "
                                 f"{', '.join(self)}")
        if set(states) != set(self):
            raise ValueError(f"optimisers {', '.join(sorted(states))} in the checkpoint, {', '.join(self)} in this "
                             f"run: a run resumes with the optimisers it was saved with")
        return states


def state_floats(optimizer):
    """fp32 numbers an optimiser keeps per parameter once it has stepped (the disk plan, bench.py's memory estimate):
    Muon's momentum (NorMuon's moments, a row or a column per matrix, left out); two moments for AdamW and any other
    (Adam's kind, the common one)."""
    return 1 if isinstance(optimizer, Muon) else 2


def describe_optimizers(optimizers, model=None):
    """One line: how many tensors and parameters each optimiser (of an Optimizers, or a list) updates, and which ones
    none does (frozen)."""
    optimizers = optimizers.values() if isinstance(optimizers, dict) else optimizers
    def count(opt):
        params = [p for g in opt.param_groups for p in g["params"]]
        return f"{type(opt).__name__} {len(params)} tensors ({sum(p.numel() for p in params):,} parameters)"
    frozen = [(n, p.numel()) for n, p in model.named_parameters() if not p.requires_grad] if model else []
    return "optimisers: " + ", ".join(count(opt) for opt in optimizers) + "".join(
        f"; frozen at its random initialisation (no gradient, in no optimiser): {n} ({k:,} parameters)"
        for n, k in frozen)


def clip_gradients(model, max_norm):
    """Clip the global gradient norm to max_norm; return the norm before clipping (a sharded model's is summed from
    its shards)."""
    return sharding.full_value(clip_norm(model, max_norm)).item()


def clip_norm(model, max_norm):
    """clip_gradients's clip, its norm left a tensor on the device (a DTensor under FSDP): no sync, and fake tensors
    (the dry run) go through."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
