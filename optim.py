"""
The optimisers of the paper's recipe: Muon (Nesterov momentum, Polar Express, NorMuon, cautious weight decay) for the
weight matrices inside the network (muon_params), AdamW for everything else.

muon_update is Muon's maths on one screen: its four steps on one matrix, in the paper's order. Muon is the optimiser
that runs them fast, on stacks of same-shaped matrices, with steps 2 and 3 where the matrices are whole: its
exchange moves them there and back (Exchange in one process, engine/parallel.py's under DDP, engine/sharding.py's
under FSDP). The tests hold every path of Muon to muon_update. train.py builds the optimisers by name
(build_optimizers: an Optimizers, which picks Muon's exchange), sets their learning rates and Muon's momentum (its
schedule), clips the gradients (clip_gradients) and steps them. Nothing here imports from engine/.
"""
import math
import sys

import torch
import torch.nn as nn

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


def muon_update(p, grad, momentum, second_moment, lr, mu, beta2, wd):
    """Muon's update of one weight matrix p (rows, cols), in place, from its gradient: the paper's four steps in
    order. momentum (like p) and second_moment (moment_shape's) are its state, updated in place. This is what
    Muon.step does to every matrix (stacked by shape, steps 2 and 3 spread over the ranks under DDP or FSDP), and
    the tests hold every path of it to this function (tests/test_train.py)."""
    # 1. Nesterov momentum, as an EMA: m <- μ·m + (1-μ)·g; the update g + μ·(m - g) looks a step further along it
    momentum.lerp_(grad, 1 - mu)
    update = grad.lerp(momentum, mu)
    # 2. Polar Express: the nearest orthogonal matrix, U Vᵀ of the update's SVD, approximately, in bf16
    o = polar_express(update).float()
    # 3. NorMuon: each row (or column) divided by the RMS of its history (the second moment, updated in place),
    #    rescaled to the orthogonalised update's norm, then the shape scaling
    normed = normuon(o, second_moment, beta2)
    # 4. Cautious weight decay and the step: p -= lr·wd·p only where the update moves p to 0, then p -= lr·update
    p.sub_(lr * wd * (normed * p >= 0) * p)
    p.sub_(lr * normed)


def polar_express(G):
    """Orthogonalise a matrix (rows, cols), or a stack of them (k, rows, cols), in bf16: U V^T of their SVD,
    approximately."""
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
    """The update of an orthogonalised matrix o (rows, cols), or of a stack of them (k, rows, cols), fp32: NorMuon's
    normalisation by the second moments v (moment_shape's, or a stack of them), which it updates in place, rescaled
    to each matrix's own norm, then the shape scaling."""
    rows, cols = o.shape[-2:]
    v.lerp_(o.square().mean(dim=-1 if rows >= cols else -2, keepdim=True), 1 - beta2)
    normed = o * v.clamp_min(NORMUON_EPS).rsqrt()
    norm = lambda x: x.norm(dim=(-2, -1), keepdim=True)  # of each matrix
    normed *= norm(o) / norm(normed).clamp_min(NORMUON_EPS)  # keep each orthogonalised update's norm
    normed *= max(1.0, rows / cols) ** 0.5
    return normed


# =============================================================================================================
# Muon: muon_update's four steps, fast, on stacks of same-shaped matrices, with steps 2 and 3 where the matrices are
# whole (an exchange); then which parameter goes where, and a run's optimisers by name.

class Muon(torch.optim.Optimizer):
    """Muon for the weight matrices: muon_update on every one, fast. The matrices of one shape are updated as one
    stack (k, rows, cols), with foreach ops for the momentum: the same ops whatever k, so that a step of the 450M
    dyn_exo layout dispatches 774 aten ops, not 4,664 (one set per matrix: tiny kernels a GPU waits to launch). The
    state stays per matrix (the checkpoint format). Steps 1 and 4 are elementwise, and run on this rank's part of
    each matrix; steps 2 and 3 take whole matrices, and run where those are: exchange, the class of which Muon makes
    one at each step, takes them there and back. Exchange (below, the default): one process, every matrix here.
    parallel.Exchange (DDP): every rank holds every matrix, orthogonalises a share of every stack and all-gathers the
    results, so that parameters and state stay identical everywhere (and checkpointable from rank 0).
    sharding.Exchange (FSDP): each matrix's owner gathers its rows from every rank, and sends each rank its rows of
    the results. train.build_optimizers picks it. The weight decay is lr · wd, as in the authors' train.py
    (modded-nanogpt scales its own by lr² instead)."""

    def __init__(self, params, lr, momentum, beta2, weight_decay, exchange=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay))
        self.exchange = exchange or Exchange
        if not self.exchange.sharded and any(is_dtensor(p) for g in self.param_groups for p in g["params"]):
            raise ValueError("Muon: FSDP's parameters (DTensors) hold some rows of each matrix, and steps 2 and 3 take "
                             "whole ones: pass exchange=sharding.Exchange (train.build_optimizers does)")

    @torch.no_grad()
    def step(self, closure=None):  # closure: the Optimizer API's (torch's state-dict functions pass None)
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(p.shape, []).append(p)
            stacks = list(by_shape.values())
            # under FSDP all stacks in one exchange, so that one all-to-all each way carries every matrix; else one
            # stack at a time, its temporaries freed before the next
            for batch in [stacks] if stacks and self.exchange.sharded else [[s] for s in stacks]:
                self.update(batch, group)

    def update(self, stacks, group):
        """muon_update's four steps on stacks of same-shaped matrices (each a list of parameters), each step on all
        the matrices of a stack at once."""
        lr, mu, beta2, wd = group["lr"], group["momentum"], group["beta2"], group["weight_decay"]
        exchange = self.exchange(stacks)
        states = [[self._state(p, exchange) for p in params] for params in stacks]
        moments = [exchange.local([s["second_moment"] for s in stack]) for stack in states]
        # 1. Nesterov momentum, on this rank's part of each matrix, a stack's with foreach ops
        updates = []
        for params, stack in zip(stacks, states):
            grads, momenta = exchange.local([p.grad for p in params]), exchange.local([s["momentum"] for s in stack])
            torch._foreach_lerp_(momenta, grads, 1 - mu)
            updates.append(torch._foreach_lerp(grads, momenta, mu))
        # steps 2 and 3 where the matrices are whole, each stack as one tensor (k, rows, cols)
        whole = exchange.to_owners(updates, moments)
        for w in whole:
            # 2. Polar Express, in bf16 (under DDP each rank on its share of the stack, all-gathered in bf16)
            o = exchange.gather(polar_express(exchange.share(w[0])), len(w[0])).float()
            # 3. NorMuon, the second moments w[1] updated in place (on every rank under DDP: they stay identical)
            w[0] = normuon(o, w[1], beta2)
        # 4. Cautious weight decay and the step, on this rank's part of each matrix, a stack as one tensor
        for params, (normed, v), moment in zip(stacks, exchange.from_owners(whole), moments):
            p = torch.stack(exchange.local(params))
            p.sub_(lr * wd * (normed * p >= 0) * p)
            p.sub_(lr * normed)
            torch._foreach_copy_(exchange.local(params), p.unbind(0))
            torch._foreach_copy_(moment, v.unbind(0))

    def _state(self, p, exchange):
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(p)
            state["second_moment"] = exchange.zeros(moment_shape(*p.shape), like=p)  # sharded like p under FSDP
        return state


class Exchange:
    """Where Muon's steps 2 and 3 find whole matrices, and how their results come back, in one process: every matrix
    is whole here, so each stack becomes one tensor and nothing moves. Muon makes one at each step from the step's
    stacks (lists of same-shaped parameters). parallel.Exchange (DDP: each rank orthogonalises a share of every
    stack) and sharding.Exchange (FSDP: each matrix to its owner and back) are subclasses, with the same methods."""
    sharded = False  # FSDP's: the parameters are DTensors, and all the stacks of a step go in one exchange

    def __init__(self, stacks):  # the step's stacks: where their matrices go (here: nowhere)
        pass

    def zeros(self, shape, like):
        """A state tensor of zeros of shape (a second moment) for the parameter like, on its device."""
        return torch.zeros(shape, device=like.device)

    def local(self, tensors):
        """This rank's part of each tensor (steps 1 and 4 run on it): all of it."""
        return tensors

    def to_owners(self, updates, moments):
        """The Nesterov updates and the second moments of each stack (lists of this rank's parts), as whole matrices
        where steps 2 and 3 run on them: [[updates (k, rows, cols), second moments (k, ...)], ...], here."""
        return [[torch.stack(u), torch.stack(v)] for u, v in zip(updates, moments)]

    def share(self, stack):
        """The matrices of a stack (k, rows, cols) that this rank orthogonalises: all of them."""
        return stack

    def gather(self, share, k):
        """Every rank's share, back as the whole stack of k matrices: this rank's is all of it."""
        return share

    def from_owners(self, whole):
        """to_owners's stacks after steps 2 and 3 ([normed updates, second moments] each), as this rank's part of each
        matrix, stacked as the step's stacks: all of it."""
        return whole


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
        """Each <name>_<key> of train.schedule()'s values into every param group of the optimiser of that name, times
        the group's <key>_scale if it has one (a factor a fork gives a group where it builds them: lr_scale=0.5, half
        the scheduled rate; check_params refuses a group that sets the key itself). Each optimiser needs its
        <name>_lr: a learning rate the config sets, never one left in a group by a loaded state. Returns the
        learning rates, <name>_lr, for the log."""
        for name, opt in self.items():
            if f"{name}_lr" not in scheduled:
                raise ValueError(f"the schedule has no {name}_lr for the optimiser {name!r}")
            for key in [k for k in scheduled if k.startswith(f"{name}_")]:
                key = key.removeprefix(f"{name}_")
                for group in opt.param_groups:
                    group[key] = scheduled[f"{name}_{key}"] * group.get(f"{key}_scale", 1.0)
        return {f"{name}_lr": scheduled[f"{name}_lr"] for name in self}

    def check_params(self, model, scheduled=()):
        """Before any step, a one-line error for what would train otherwise than the code reads, and fail nowhere by
        itself: a trained parameter of model in two of these optimisers (updated twice a step) or in none (never
        updated); a model of model's class inside it (a teacher: trained with it, and saved as its weights); a param
        group that sets a key the schedule (scheduled: train.schedule's values at a step) writes into every group,
        which the first step would overwrite, where a factor (<key>_scale) keeps what makes the groups differ."""
        nested = [name for name, m in model.named_modules() if name and type(m) is type(model)]
        if nested:
            raise ValueError(f"model.{nested[0]}: a {type(model).__name__} inside the model, which its optimisers "
                             f"would train (unless frozen) and its checkpoints save as its weights: hold it beside the "
                             f"model (a Run attribute set in train.build)")
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
        for name, opt in self.items():
            for key in [k.removeprefix(f"{name}_") for k in scheduled if k.startswith(f"{name}_")]:
                for i, group in enumerate(opt.param_groups):
                    peak, own, factor = opt.defaults.get(key), group.get(key), group.get(f"{key}_scale", 1.0)
                    if peak and own is not None and not any(math.isclose(own, peak * f) for f in (1.0, factor)):
                        raise ValueError(f"optimiser {name!r}, param group {i}: {key}={own:g}, which the schedule "
                                         f"overwrites with {name}_{key} at every step: give the group "
                                         f"{key}_scale={own / peak:g} (a factor of {name}_{key}) instead")

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
        for name, state in states.items():  # the groups' factors (set_schedule), which the recipe gives them
            for i, (mine, saved) in enumerate(zip(self[name].param_groups, state["param_groups"])):
                for key in sorted(k for k in {**mine, **saved} if k.endswith("_scale")):
                    if mine.get(key, 1.0) != saved.get(key, 1.0):
                        raise ValueError(f"optimiser {name!r}, param group {i}: {key}={saved.get(key, 1.0)!r} in the "
                                         f"checkpoint, {key}={mine.get(key, 1.0)!r} in this run: a run continues "
                                         f"with the recipe it was saved with")
        return states


def state_floats(optimizer):
    """fp32 numbers an optimiser keeps per parameter once it has stepped (the disk plan, bench.py's memory estimate):
    Muon's momentum (NorMuon's moments, a row or a column per matrix, left out); two moments for AdamW and any other
    (Adam's kind, the common one)."""
    return 1 if isinstance(optimizer, Muon) else 2


def describe_optimizers(optimizers, model=None, never_trained=()):
    """One line: how many tensors and parameters each optimiser (of an Optimizers, or a list) updates, and which of
    model's none does, each module once: those of never_trained (parameter names) frozen at their random
    initialisation, any other not trained here (a fork's, loaded: no gradient)."""
    optimizers = optimizers.values() if isinstance(optimizers, dict) else optimizers
    count = lambda params: f"{len(params)} tensors ({sum(p.numel() for p in params):,} parameters)"
    params = lambda opt: [p for g in opt.param_groups for p in g["params"]]
    line = "optimisers: " + ", ".join(f"{type(opt).__name__} {count(params(opt))}" for opt in optimizers)
    untrained = {}  # (never trained?, the model's child that holds them) -> [(name, parameter)] without gradient
    for name, p in (model.named_parameters() if model is not None else ()):
        if not p.requires_grad:
            untrained.setdefault((name in never_trained, name.split(".")[0]), []).append((name, p))
    one = lambda named: f"{named[0][0]} ({named[0][1].numel():,} parameters)"  # a child's one tensor, by its name
    for random_init, what in ((True, "frozen at its random initialisation"), (False, "not trained here")):
        found = [one(named) if len(named) == 1 else f"{child}: {count([p for _, p in named])}"
                 for (kind, child), named in untrained.items() if kind == random_init]
        line += f"; {what} (no gradient, in no optimiser): {', '.join(found)}" if found else ""
    return line


def clip_gradients(model, max_norm):
    """Clip the global gradient norm to max_norm; return the norm before clipping (a sharded model's is summed from
    its shards)."""
    norm = clip_norm(model, max_norm)
    return (norm.full_tensor() if is_dtensor(norm) else norm).item()


def clip_norm(model, max_norm):
    """clip_gradients's clip, its norm left a tensor on the device (a DTensor under FSDP): no sync, and fake tensors
    (the dry run) go through."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def is_dtensor(t):
    """Whether t is FSDP's, a DTensor (sharding.is_sharded asks this). DTensor is not imported for it (about 1 CPU-s:
    sharding.py): until something has imported it, no tensor is one."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)
