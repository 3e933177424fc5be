"""One OT problem spread over the processes of a ``torchrun`` job (:mod:`flashot.distributed`).

    torchrun --standalone --nproc-per-node=2 examples/distributed_solve.py

Every rank builds the same clouds (replicated mode), computes its slice of the rows and
all-gathers the potentials; values, potentials and gradients are the same on every rank.
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

if rank == 0:
    print(f"{dist.get_world_size()} ranks, engine {res.backend}: OT = {res.value.item():.6f} "
          f"({res.n_iter} iterations, converged {res.converged}), |grad x| = {float(x.grad.norm()):.6f}, "
          f"S_eps = {loss.item():.6f}")
dist.barrier()  # no rank tears the group down while another still uses it
dist.destroy_process_group()
# torch's gloo can abort at interpreter exit ("terminate called without an active exception",
# pytorch/pytorch#190489): once everything is written, leave without the interpreter's teardown.
sys.stdout.flush()
os._exit(0)
