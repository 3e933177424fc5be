"""One OT problem spread over the processes of a ``torchrun`` job (:mod:`flashot.distributed`).

    torchrun --standalone --nproc-per-node=2 examples/distributed_solve.py

Replicated mode: every rank builds the same clouds, computes its slice of the rows and
all-gathers the potentials; values, potentials and gradients are the same on every rank.
Points-sharded mode (``shard="points"``): every rank passes only its slice of the clouds (here a
contiguous slice of the same generated points; in practice, the rank's own shard of the data);
blocks travel around a ring of the ranks; the value is the whole problem's, the potentials and
gradients are the rank's slices.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

import flashot

# gloo on CPUs ("nccl" on GPUs); a rank that hangs makes the others fail after `timeout`
dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
pg, rank = dist.group.WORLD, dist.get_rank()

gen = torch.Generator().manual_seed(0)  # the same points on every rank
x = torch.randn(6000, 3, generator=gen).requires_grad_()
y = torch.randn(5000, 3, generator=gen) + 1.0

res = flashot.solve_sample(x, y, reg=0.1, group=pg)  # POT-style solve, one problem over all ranks
res.value.backward()  # the backward's plan products are sharded too: call it on every rank
loss = flashot.SamplesLoss(blur=0.05, group=pg)(x, y)  # GeomLoss-style Sinkhorn divergence

# points-sharded mode: this rank's slices only (uneven slices are fine; none may be empty)
world = dist.get_world_size()
xs = x.detach()[rank * len(x) // world : (rank + 1) * len(x) // world].clone().requires_grad_()
ys = y[rank * len(y) // world : (rank + 1) * len(y) // world]
res_p = flashot.solve_sample(xs, ys, reg=0.1, group=pg, shard="points")  # a=None: 1/N over all ranks' points
res_p.value.backward()  # xs.grad: this rank's rows of the gradient
grad_sq = torch.tensor([float(xs.grad.norm()) ** 2])
dist.all_reduce(grad_sq, group=pg)  # |grad x|^2 summed over the ranks' slices

if rank == 0:
    print(
        f"{world} ranks, engine {res.backend}: OT = {res.value.item():.6f} "
        f"({res.n_iter} iterations, converged {res.converged}), |grad x| = {float(x.grad.norm()):.6f}, "
        f"S_eps = {loss.item():.6f}"
    )
    print(
        f"points-sharded, engine {res_p.backend}: OT = {res_p.value.item():.6f} ({res_p.n_iter} iterations), "
        f"|grad x| = {float(grad_sq.sqrt()):.6f}"
    )
dist.barrier()  # no rank tears the group down while another still uses it
dist.destroy_process_group()
# torch's gloo can abort at interpreter exit ("terminate called without an active exception",
# pytorch/pytorch#190489): once everything is written, leave without the interpreter's teardown.
sys.stdout.flush()
os._exit(0)
