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


class Muon(torch.optim.Optimizer):
    """Muon for the weight matrices: Nesterov momentum (EMA form), Polar Express, NorMuon second
    moment, shape scaling, cautious weight decay. The matrices of one shape are updated as one stack
    (k, rows, cols), with foreach ops for the momentum: the same ops whatever k, so that a step of the 450M
    dyn_exo layout dispatches 779 aten ops, not 4,664 (one set per matrix: tiny kernels a GPU waits to launch).
    Under DDP each rank orthogonalises only its share of every stack and all-gathers the results; the cheap
    elementwise work runs on every rank, so parameters and optimiser state stay identical everywhere (and
    checkpointable from rank 0). The weight decay is lr · wd, as in the authors' train.py (modded-nanogpt
    scales its own by lr² instead)."""

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
    def step(self):
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(p.shape, []).append(p)
            for params in by_shape.values():
                self._step_stack(params, group)

    def _step_stack(self, params, group):
        """One step of same-shaped matrices; the state stays per matrix (the checkpoint format)."""
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        rows, cols = params[0].shape  # NorMuon: one second moment per row if rows >= cols, else per column
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["momentum"] = torch.zeros_like(p)
                state["second_moment"] = torch.zeros((rows, 1) if rows >= cols else (1, cols), device=p.device)
        grads, momenta = [p.grad for p in params], [s["momentum"] for s in states]
        torch._foreach_lerp_(momenta, grads, 1 - mu)
        u = self._orthogonalize(torch._foreach_lerp(grads, momenta, mu)).float()  # Nesterov
        v = torch.stack([s["second_moment"] for s in states])  # (k, rows, 1) or (k, 1, cols)
        v.lerp_(u.square().mean(dim=-1 if rows >= cols else -2, keepdim=True), 1 - group["beta2"])
        normed = u * v.clamp_min(NORMUON_EPS).rsqrt()
        norm = lambda x: x.norm(dim=(-2, -1), keepdim=True)  # of each matrix
        normed *= norm(u) / norm(normed).clamp_min(NORMUON_EPS)  # keep each orthogonalised update's norm
        normed *= max(1.0, rows / cols) ** 0.5
        p = torch.stack(params)
        # cautious weight decay: only where the update already moves the weight towards zero
        p.sub_(lr * wd * (normed * p >= 0) * p)
        p.sub_(lr * normed)
        torch._foreach_copy_(params, p.unbind(0))
        torch._foreach_copy_([s["second_moment"] for s in states], v.unbind(0))


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
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grad_norm.item()
