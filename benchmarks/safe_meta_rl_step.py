"""Time per meta-gradient of safe meta-RL on SafeGridNav, first-order (Hessian-free) against second-order MAML,
as ratios in the same run, for growing grids.

    python benchmarks/safe_meta_rl_step.py [--sizes 6 10 14 18] [--tasks 3] [--repeats 10]

Per grid size (S = n^2 states), from the same feasible logits, the median over ``--repeats`` of:
``hf_safe`` (closed-form safe step incl. the dual solve, then the exact first-order gradient),
``hf_pg`` (the same policy-gradient inner step as MAML, first-order gradient at the adapted logits),
``so_pg`` (MAML: autograd through the inner policy-gradient step, Hessian-vector products included).
"""

from __future__ import annotations

import argparse

import torch
from timing import median_time, recorded

from lowrank_lit.envs import SafeGridNav
from lowrank_lit.methods.safe_meta_rl import (
    feasible_anchor_logits,
    hessian_free_meta_grad,
    second_order_meta_grad,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[6, 10, 14, 18])
    ap.add_argument("--tasks", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| grid | states | hf_safe (ms) | hf_pg (ms) | so_pg (ms) | hf_safe / so_pg | hf_pg / so_pg |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        env = SafeGridNav(size=n)
        phi = feasible_anchor_logits(env)
        tasks = list(range(min(args.tasks, env.num_tasks)))
        hf = median_time(lambda e=env, p=phi, t=tasks: hessian_free_meta_grad(e, p, t, 0.1, 0.1, "safe"), args.repeats, warmup=1)
        hp = median_time(lambda e=env, p=phi, t=tasks: hessian_free_meta_grad(e, p, t, 0.1, 0.1, "pg_lagrange"), args.repeats, warmup=1)
        so = median_time(lambda e=env, p=phi, t=tasks: second_order_meta_grad(e, p, t, 1.0, 1.0), args.repeats, warmup=1)
        print(f"| {n} x {n} | {env.S} | {1e3 * hf:.1f} | {1e3 * hp:.1f} | {1e3 * so:.1f} | {hf / so:.2f} | {hp / so:.2f} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
