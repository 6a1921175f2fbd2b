"""Safe meta-RL (paper 04): the dual solve and the closed-form safe step (bandit numbers, slackness, limits,
convexity), exact tabular evaluation, the Hessian-free meta-gradient against finite differences, anytime
safety on SafeGridNav, bad inputs, configs end to end, and the reproduction (slow)."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from lowrank_lit.envs import SafeGridNav, evaluate, state_occupancy
from lowrank_lit.methods.safe_meta_rl import (
    InfeasibleAnchorError,
    adapt_tabular,
    constraint_value,
    dual_objective,
    hessian_free_meta_grad,
    safe_adapt,
    sample_weights,
    second_order_meta_grad,
    solve_dual,
    tabular_policy_gradient,
    tilt,
)
from tests.tolerances import F32, F32_LAYERS, F32_NET, F64

D = torch.float64


def _bandit() -> tuple[torch.Tensor, ...]:
    pi0 = torch.full((1, 3), 1 / 3, dtype=D)
    r, c = torch.tensor([[1, 0.5, 0]], dtype=D), torch.tensor([[1, 0, 0.2]], dtype=D)
    return pi0, r - (pi0 * r).sum(), c - (pi0 * c).sum(), c, torch.ones(1, dtype=D)


def _safe_anchor(env: SafeGridNav) -> torch.Tensor:
    """A feasible anchor: 90 % right along row 0 then down the last column (avoids the band), 10 % uniform."""
    pi_safe = torch.zeros(env.S, env.A, dtype=D)
    for s in range(env.S):
        i, j = divmod(s, env.size)
        pi_safe[s, 1 if i == 0 and j < env.size - 1 else 2] = 1
    return 0.9 * pi_safe + 0.1 / env.A


def test_bandit_numbers():
    """One state, gamma = 0: pi0 uniform, r = (1, .5, 0), c = (1, 0, .2), d = 0.45, eta = kappa = 0.1."""
    pi0, ar, ac, c, occ = _bandit()
    b = 0.45 - 0.4
    pi1, nu = safe_adapt(pi0, ar, ac, occ, b, 0.1, 0.1)
    assert nu == pytest.approx(0.5527, abs=F32_NET)
    torch.testing.assert_close(pi1, torch.tensor([[0.4112, 0.5775, 0.0113]], dtype=D), atol=F32_NET, rtol=0)
    assert float((pi1 * c).sum()) == pytest.approx(0.4135, abs=F32_NET) and float((pi1 * c).sum()) <= 0.45
    # the surrogate constraint is active at nu* > 0 (complementary slackness)
    assert float(constraint_value(pi1.log(), pi0.log(), ac, occ, 0.1)) == pytest.approx(b, abs=F64)
    # nu = 0 (the unconstrained tilt) violates
    log_pi, _, _ = tilt(pi0.log(), ar, ac, 0.0, 0.1, 0.1)
    assert float((log_pi.exp() * c).sum()) == pytest.approx(0.993, abs=1e-3)  # tol: the value to its printed 3 digits


def test_dual_slackness_limits_and_convexity():
    pi0, ar, ac, c, occ = _bandit()
    # a loose budget: the unconstrained tilt is feasible -> nu* = 0
    assert solve_dual(pi0.log(), ar, ac, occ, 10.0, 0.1, 0.1) == 0.0
    # g convex on a grid, and nu* at its grid minimum
    grid = [i * 0.01 for i in range(301)]
    g = [dual_objective(v, pi0.log(), ar, ac, occ, 0.05, 0.1, 0.1) for v in grid]
    assert all(g[i - 1] + g[i + 1] - 2 * g[i] >= -1e-12 for i in range(1, len(g) - 1))
    nu = solve_dual(pi0.log(), ar, ac, occ, 0.05, 0.1, 0.1)
    assert abs(nu - grid[min(range(len(g)), key=g.__getitem__)]) <= 0.01
    assert dual_objective(nu, pi0.log(), ar, ac, occ, 0.05, 0.1, 0.1) <= min(g) + 1e-9
    # eta -> inf: pi_nu -> pi0; zero advantages: pi_nu == pi0
    pi_big, _ = safe_adapt(pi0, ar, ac, occ, 10.0, 1e9, 0.1)
    torch.testing.assert_close(pi_big, pi0, atol=F64, rtol=0)
    pi_z, _ = safe_adapt(pi0, torch.zeros_like(ar), torch.zeros_like(ac), occ, 0.0, 0.1, 0.1)
    torch.testing.assert_close(pi_z, pi0)
    # rows are distributions, also with |z| ~ 1e3 (log-sum-exp, no overflow)
    torch.manual_seed(0)
    pi = torch.softmax(torch.randn(5, 4, dtype=D), 1)
    big_r, big_c = 100 * torch.randn(5, 4, dtype=D), 100 * torch.randn(5, 4, dtype=D)
    p1, nu = safe_adapt(pi, big_r, big_c, torch.full((5,), 0.2, dtype=D), 0.0, 0.1, 0.0)
    assert bool(torch.isfinite(p1).all()) and torch.allclose(p1.sum(1), torch.ones(5, dtype=D))
    assert float(constraint_value(p1.clamp_min(1e-300).log(), pi.log(), big_c, torch.full((5,), 0.2, dtype=D), 0.0)) <= 1e-6


def test_sample_weights_are_the_one_state_dual():
    torch.manual_seed(1)
    ar = torch.randn(64, dtype=D)
    ac = ar + 0.3 * torch.randn(64, dtype=D)  # reward and cost advantages correlated: the constraint binds
    ar, ac = ar - ar.mean(), ac - ac.mean()
    w, nu = sample_weights(ar, ac, 0.05, 0.5, 0.1)
    assert w.sum().item() == pytest.approx(1.0) and nu > 0
    kl = float((w * (w * 64).log()).sum())
    assert float((w * ac).sum()) + 0.1 * kl == pytest.approx(0.05, abs=F32)
    w0, nu0 = sample_weights(ar, ac, 0.05, 0.5, 0.1, constrained=False)
    assert nu0 == 0 and float((w0 * ac).sum()) + 0.1 * float((w0 * (w0 * 64).log()).sum()) > 0.05


def test_exact_evaluation_bellman_and_occupancy():
    env = SafeGridNav()
    torch.manual_seed(0)
    pi = torch.softmax(torch.randn(env.S, env.A, dtype=D), 1)
    r = env.reward(2)
    ev = evaluate(env.P, pi, r, env.mu0, env.gamma)
    bellman = (pi * (r + env.gamma * torch.einsum("sat,t->sa", env.P, ev.V))).sum(1) - ev.V
    assert float(bellman.abs().max()) < 1e-12
    occ = state_occupancy(env.P, pi, env.mu0, env.gamma)
    assert float(occ.sum()) == pytest.approx(1.0, abs=F64) and bool((occ >= 0).all())
    # performance difference: J(pi') - J(pi) = E_{d_pi'} E_pi' [A_pi] / (1 - gamma)
    pi2 = torch.softmax(torch.randn(env.S, env.A, dtype=D), 1)
    lhs = evaluate(env.P, pi2, r, env.mu0, env.gamma).J - ev.J
    rhs = state_occupancy(env.P, pi2, env.mu0, env.gamma) @ (pi2 * ev.A).sum(1) / (1 - env.gamma)
    assert float(lhs) == pytest.approx(float(rhs), abs=F64)
    assert torch.allclose(env.P.sum(2), torch.ones(env.S, env.A, dtype=D))


def test_hessian_free_gradient_matches_finite_differences():
    """grad_phi J_r(softmax(phi + z)) with z fixed, against central differences and autograd."""
    env = SafeGridNav()
    torch.manual_seed(0)
    phi = _safe_anchor(env).log() + 0.1 * torch.randn(env.S, env.A, dtype=D)
    _, z, nu = adapt_tabular(env, torch.softmax(phi, 1), 4, 0.1, 0.1, "safe")
    grad, stats = hessian_free_meta_grad(env, phi, [4], 0.1, 0.1, "safe")
    assert stats["infeasible"] == 0 and stats["nu"] == pytest.approx(nu)

    def J(p: torch.Tensor) -> torch.Tensor:
        return evaluate(env.P, torch.softmax(p + z, 1), env.reward(4), env.mu0, env.gamma).J

    fd = torch.zeros_like(phi)
    for s in (0, 1, 6, 20, 35):
        for a in range(4):
            e = torch.zeros_like(phi)
            e[s, a] = 1e-6
            fd[s, a] = (J(phi + e) - J(phi - e)) / 2e-6
            assert float(grad[s, a]) == pytest.approx(float(fd[s, a]), abs=F32)
    p = phi.clone().requires_grad_(True)
    (auto,) = torch.autograd.grad(J(p), p)
    torch.testing.assert_close(grad, auto, atol=F64, rtol=F64)
    # the second-order baseline is the autograd derivative through the inner step
    g2, _ = second_order_meta_grad(env, phi, [4], 1.0, 1.0)
    from lowrank_lit.methods.safe_meta_rl import pg_lagrange_step

    e = torch.zeros_like(phi)
    e[0, 1] = 1e-6

    def J2(p: torch.Tensor) -> float:
        p1 = pg_lagrange_step(env, p.clone(), 4, 1.0, 1.0)
        return float(evaluate(env.P, torch.softmax(p1.detach(), 1), env.reward(4), env.mu0, env.gamma).J)

    assert float(g2[0, 1]) == pytest.approx((J2(phi + e) - J2(phi - e)) / 2e-6, abs=F32)


def test_tabular_policy_gradient_is_the_softmax_gradient():
    env = SafeGridNav()
    torch.manual_seed(2)
    phi = torch.randn(env.S, env.A, dtype=D, requires_grad=True)
    J = evaluate(env.P, torch.softmax(phi, 1), env.c, env.mu0, env.gamma).J
    (auto,) = torch.autograd.grad(J, phi)
    torch.testing.assert_close(tabular_policy_gradient(env, torch.softmax(phi.detach(), 1), env.c), auto)


def test_anytime_safety_on_gridnav():
    """From a feasible anchor, J_c <= d after each of 5 successive steps on every goal, for several (eta, kappa > 0).
    (With kappa = 0 the surrogate is not conservative and J_c can end a hair above d, e.g. 0.80002.)"""
    env = SafeGridNav()
    pi0 = _safe_anchor(env)
    assert float(env.evaluate(torch.full((env.S, env.A), 0.25, dtype=D), 0)[1].J) > env.limit  # uniform is unsafe
    for eta, kappa in ((0.1, 0.1), (0.05, 0.1), (0.5, 0.5), (0.1, 1.0)):
        for task in range(env.num_tasks):
            pi = pi0
            assert float(env.evaluate(pi, task)[1].J) <= env.limit
            for _ in range(5):
                pi, _, _ = adapt_tabular(env, pi, task, eta, kappa, "safe")
                assert float(env.evaluate(pi, task)[1].J) <= env.limit + 1e-9, (eta, kappa, task)


def test_bad_inputs_raise_named_errors():
    pi0, ar, ac, _, occ = _bandit()
    with pytest.raises(InfeasibleAnchorError, match="b=-0.1"):
        safe_adapt(pi0, ar, ac, occ, -0.1, 0.1, 0.1)
    with pytest.raises(ValueError, match="eta=0"):
        safe_adapt(pi0, ar, ac, occ, 0.1, 0, 0.1)
    with pytest.raises(ValueError, match="kappa=-1"):
        safe_adapt(pi0, ar, ac, occ, 0.1, 0.1, -1)
    with pytest.raises(ValueError, match="sum to 1"):
        safe_adapt(torch.tensor([[0.5, 0.6, 0.1]], dtype=D), ar, ac, occ, 0.1, 0.1, 0.1)
    with pytest.raises(ValueError, match="advantages of shapes"):
        safe_adapt(pi0, ar[:, :2], ac, occ, 0.1, 0.1, 0.1)
    with pytest.raises(ValueError, match="occupancy of shape"):
        safe_adapt(pi0, ar, ac, torch.ones(2, dtype=D), 0.1, 0.1, 0.1)
    with pytest.raises(ValueError, match="adv_r contains NaN"):
        safe_adapt(pi0, torch.full_like(ar, math.nan), ac, occ, 0.1, 0.1, 0.1)
    with pytest.raises(ValueError, match="gamma=1"):
        SafeGridNav(gamma=1.0)
    env = SafeGridNav()
    with pytest.raises(ValueError, match="gamma=1.0"):
        evaluate(env.P, torch.full((env.S, env.A), 0.25, dtype=D), env.c, env.mu0, 1.0)
    from lowrank_lit.methods.safe_meta_rl import SafeMetaRLModule, TaskDataModule

    with pytest.raises(ValueError, match="adapt='maml'.*allowed: safe, unconstrained, pg_lagrange"):
        SafeMetaRLModule(env, adapt="maml")
    with pytest.raises(ValueError, match="in both train_tasks and test_tasks"):
        TaskDataModule([0, 1, 2], [2, 3])


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["gridnav_safe", "gridnav_unconstrained", "gridnav_pg_lagrange", "gridnav_second_order"])
def test_config_runs_and_monitor_writes(name, tmp_path):
    from lowrank_lit.report import last_values
    from tests.helpers import CONFIGS, run_cli

    assert run_cli("fit", "--config", CONFIGS / "safe_meta_rl" / f"{name}.yaml", "--trainer.max_epochs=1",
                   "--data.init_args.steps_per_epoch=5", "--trainer.log_every_n_steps=1", "--run_id=smoke", "--trainer.enable_progress_bar=false",
                   run_root=tmp_path) == 0
    run = tmp_path / "safe_meta_rl" / name / "smoke"
    vals = last_values(run / "metrics.csv")
    assert {"test/violations", "test/J_r_final", "test/step5/J_c", "train/step_s", "train/lambda"} <= set(vals)
    with open(run / "adaptation_test.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 6 and (run / "adaptation_test.png").is_file()


# -- neural path -------------------------------------------------------------------------------------------

def test_continuous_families_are_vectorised_and_seeded():
    from lowrank_lit.envs import PointNav2D, VelocityCart

    for env in (PointNav2D(), VelocityCart()):
        pol = lambda o, env=env: torch.ones(*o.shape[:-1], env.act_dim)  # noqa: E731  constant push
        ro = env.rollout(pol, torch.tensor([0, 3]), 5, torch.Generator().manual_seed(0))
        H = env.horizon
        assert ro.obs.shape == (2, 5, H, env.obs_dim) and ro.rew.shape == (2, 5, H) == ro.cost.shape
        ro2 = env.rollout(pol, torch.tensor([0, 3]), 5, torch.Generator().manual_seed(0))
        assert torch.equal(ro.rew, ro2.rew)
        # one task alone gives the same trajectory as inside the batch (no cross-talk)
        one = env.rollout(pol, torch.tensor([3]), 5, torch.Generator().manual_seed(0))
        assert one.rew.shape == (1, 5, H)
    # point nav: pushing (1, 1) for 40 steps walks 0.1 per step per axis (clipped)
    env = PointNav2D()
    ro = env.rollout(lambda o: 3 * torch.ones(*o.shape[:-1], 2), torch.tensor([1]), 2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(ro.obs[0, :, 1] - ro.obs[0, :, 0], torch.full((2, 2), 0.1))
    # the hazard disc on the way to goal 0 costs when crossed; goal 1's direction is clear
    straight0 = env.rollout(lambda o: torch.tensor([1.0, 0.0]).expand(*o.shape[:-1], 2), torch.tensor([0]), 2, torch.Generator().manual_seed(0))
    assert float(straight0.cost.sum()) > 0
    cart = VelocityCart()
    ro = cart.rollout(lambda o: torch.ones(*o.shape[:-1], 1), torch.tensor([7]), 2, torch.Generator().manual_seed(0))
    assert float(ro.cost[0, :, :5].sum()) == 0 and float(ro.cost[0, :, -5:].mean()) == 1  # speeds past v_max
    with pytest.raises(ValueError, match="tasks \\[9\\]; allowed: 0..7"):
        env.rollout(lambda o: o, torch.tensor([9]), 2, torch.Generator())


def test_gae_gaussian_policy_and_projection():
    from lowrank_lit.methods.safe_meta_rl import GaussianPolicy, gae, weighted_ml_projection

    torch.manual_seed(0)
    rew = torch.randn(2, 6, 7)
    # lambda = 1: advantages = discounted return-to-go minus the time-indexed mean baseline
    adv = gae(rew, 0.9, 1.0)
    ret = torch.stack([(rew[..., t:] * 0.9 ** torch.arange(7 - t)).sum(-1) for t in range(7)], -1)
    torch.testing.assert_close(adv, ret - ret.mean(1, keepdim=True), atol=F32_LAYERS, rtol=F32_LAYERS)
    pol = GaussianPolicy(3, 2, 16)
    obs, act = torch.randn(10, 3), torch.randn(10, 2)
    dist = torch.distributions.Normal(pol.mean(obs), pol.log_std.exp())
    torch.testing.assert_close(pol.log_prob(obs, act), dist.log_prob(act).sum(-1))
    # projection: weights on one action cluster pull the mean there
    obs = torch.zeros(200, 3)
    act = torch.cat([torch.full((100, 2), 1.0), torch.full((100, 2), -1.0)])
    w = torch.cat([torch.full((100,), 0.9 / 100), torch.full((100,), 0.1 / 100)])
    weighted_ml_projection(pol.log_prob, list(pol.parameters()), obs, act, w, steps=300, lr=3e-2)
    assert torch.allclose(pol.mean(obs[:1]), torch.full((1, 2), 0.8), atol=0.05)  # tol: 300 Adam steps, not to convergence


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["pointnav_safe", "pointnav_pg_lagrange", "velocitycart_safe", "halfcheetah_velocity"])
def test_neural_config_runs(name, tmp_path):
    from lowrank_lit.report import last_values
    from tests.helpers import CONFIGS, run_cli

    extra = ["--model.init_args.env.init_args.horizon=20"] if name == "halfcheetah_velocity" else []
    assert run_cli("fit", "--config", CONFIGS / "safe_meta_rl" / f"{name}.yaml", "--trainer.max_epochs=1",
                   "--data.init_args.steps_per_epoch=2", "--trainer.log_every_n_steps=1", "--model.init_args.n_envs=4",
                   "--model.init_args.adapt_steps=2", *extra, "--run_id=smoke", "--trainer.enable_progress_bar=false",
                   run_root=tmp_path) == 0
    run = tmp_path / "safe_meta_rl" / name / "smoke"
    vals = last_values(run / "metrics.csv")
    assert {"test/violations", "test/J_r_final", "test/step0/J_c", "test/stopped", "train/lambda", "train/J_r"} <= set(vals)
    assert (run / "adaptation_test.png").is_file()


# -- must show (card section 4) -----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.no_verdict("properties of every safe step of every run (J_r rises, J_c <= d) and a violation under nu = 0, no mean")
def test_must_show_gridnav(tmp_path):
    """Our acceptance criterion on SafeGridNav (configs' budget), seeds 0-2: on each of the 3 held-out goals,
    J_r rises at every one of the 5 safe steps and J_c <= d after every step; the nu = 0 step violates on at least
    one task; the first-order meta-step is faster than the second-order one (ratio printed, not asserted)."""
    import statistics

    from lowrank_lit.report import last_values
    from tests.helpers import CONFIGS, run_cli

    times = {}
    for seed in range(3):
        for name in ("gridnav_safe", "gridnav_unconstrained", "gridnav_second_order"):
            assert run_cli("fit", "--config", CONFIGS / "safe_meta_rl" / f"{name}.yaml", f"--seed_everything={seed}",
                           f"--run_id=seed{seed}", "--trainer.enable_progress_bar=false", run_root=tmp_path) == 0
            run = tmp_path / "safe_meta_rl" / name / f"seed{seed}"
            with open(run / "adaptation_test.csv") as f:
                rows = list(csv.DictReader(f))
            with open(run / "metrics.csv") as f:
                times.setdefault(name, []).extend(float(r["train/step_s"]) for r in csv.DictReader(f) if r.get("train/step_s"))
            if name == "gridnav_safe":
                for task in {r["task"] for r in rows}:
                    tr = sorted((r for r in rows if r["task"] == task), key=lambda r: int(r["step"]))
                    assert len(tr) == 6
                    assert all(float(b["J_r"]) > float(a["J_r"]) for a, b in zip(tr, tr[1:], strict=False)), (seed, task)
                    assert all(float(r["J_c"]) <= 0.8 for r in tr), (seed, task)
            if name == "gridnav_unconstrained":
                assert last_values(run / "metrics.csv")["test/violations"] >= 1
    ratio = statistics.median(times["gridnav_safe"]) / statistics.median(times["gridnav_second_order"])
    print(f"meta-step time, first-order safe / second-order MAML: {ratio:.2f}")


@pytest.fixture(scope="module")
def pointnav_runs(tmp_path_factory):
    """PointNav2D (policy network), seeds 0-9 (the seed budget), the safe step, the fixed multiplier and nu = 0 (as
    sweeps/safe_meta_rl_pointnav.yaml runs them): ``{adapt: [final metrics per seed]}``."""
    from lowrank_lit.report import last_values
    from tests.helpers import CONFIGS, run_cli

    root = tmp_path_factory.mktemp("pointnav")
    out: dict[str, list[dict[str, float]]] = {}
    for adapt in ("safe", "pg_lagrange", "unconstrained"):
        for seed in range(10):  # the seed budget (docs/reproduce.md, "How many seeds")
            assert run_cli("fit", "--config", CONFIGS / "safe_meta_rl" / "pointnav_safe.yaml", f"--model.init_args.adapt={adapt}",
                           f"--seed_everything={seed}", f"--run_id={adapt}_seed{seed}", "--trainer.enable_progress_bar=false",
                           run_root=root) == 0
            out.setdefault(adapt, []).append(last_values(root / "safe_meta_rl" / "pointnav_safe" / f"{adapt}_seed{seed}" / "metrics.csv"))
    return out


def _violations(runs: list[dict[str, float]]) -> float:
    return sum(m["test/violations"] for m in runs)


@pytest.mark.slow
def test_must_show_pointnav_fewer_violations(pointnav_runs):
    """PointNav2D over seeds 0-9: in total the safe step violates no more often than the fixed multiplier (1 against
    2), and both far less than nu = 0 (24). Judged by the verdict rule, paired by seed, with delta = 0.5 violations
    per seed (safe 1 on seed 1; fixed multiplier 2 on seed 0; nu = 0: 7, 3, 9, 0, 0, 0, 2, 3, 0, 0), each comparison
    is inconclusive: safe against the fixed multiplier +0.1 fewer, 95 % interval [-0.43, +0.63]; safe against
    nu = 0 +2.3, [-0.01, +4.61] (five seeds with no violation under nu = 0)."""
    from lowrank_lit.stats import expect_verdict

    v = {a: _violations(r) for a, r in pointnav_runs.items()}
    assert v["safe"] <= v["pg_lagrange"] < v["unconstrained"], v
    fewer = {a: [-m["test/violations"] for m in r] for a, r in pointnav_runs.items()}  # higher is better
    expect_verdict("inconclusive", fewer["safe"], fewer["pg_lagrange"], delta=0.5, claim="safe violates less than the fixed multiplier")
    expect_verdict("inconclusive", fewer["safe"], fewer["unconstrained"], delta=0.5, claim="safe violates less than nu = 0")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="PointNav2D seeds 0-9: safe step 1 violation (seed 1), final J_r -16.46 +/- 1.70; "
                   "fixed multiplier 2 violations, -16.12 +/- 1.36; reward inconclusive, -0.34 [-1.05, +0.37] "
                   "(docs/methods/safe_meta_rl.md, Not reproduced here)")
def test_must_show_pointnav_safe_and_better_than_the_fixed_multiplier(pointnav_runs):
    """Our acceptance criterion: zero violations after every step over 10 seeds (a count, on every seed), and a final
    reward above the fixed-multiplier baseline's, judged by the verdict rule (paired over seeds 0-9): must hold."""
    from lowrank_lit.stats import verdict

    final = {a: [m["test/J_r_final"] for m in r] for a, r in pointnav_runs.items()}
    v = verdict(final["safe"], final["pg_lagrange"], delta=0.5)  # delta: half a unit of discounted reward
    print(v, final)
    assert _violations(pointnav_runs["safe"]) == 0 and v.outcome == "holds", (str(v), final)


def test_tilt_rejects_rows_that_are_not_distributions():
    pi0, ar, ac, _c, _occ = _bandit()
    with pytest.raises(ValueError, match=r"tilt: log_pi0 row 0 sums to 1.5 as probabilities"):
        tilt((1.5 * pi0).log(), ar, ac, 0.0, 0.1, 0.1)


def test_evaluate_many_equals_evaluate_and_occupancy():
    from lowrank_lit.envs import SafeGridNav
    from lowrank_lit.envs.gridnav import evaluate, evaluate_many, state_occupancy

    env = SafeGridNav(size=5)
    pi = torch.softmax(torch.randn(env.S, env.A, generator=torch.Generator().manual_seed(0), dtype=torch.float64), 1)
    rewards = [env.c, env.reward(0), env.reward(1)]
    evs, occ = evaluate_many(env.P, pi, rewards, env.mu0, env.gamma)
    torch.testing.assert_close(occ, state_occupancy(env.P, pi, env.mu0, env.gamma), rtol=0, atol=F64)
    for ev, r in zip(evs, rewards, strict=True):
        ref = evaluate(env.P, pi, r, env.mu0, env.gamma)
        for field in ("V", "Q", "A", "J"):
            torch.testing.assert_close(getattr(ev, field), getattr(ref, field), rtol=0, atol=F64)


@pytest.mark.parametrize("mode", ["safe", "unconstrained"])
def test_meta_gradient_with_one_anchor_evaluation_equals_the_per_task_steps(mode):
    """The meta-gradient evaluates the anchor once for all tasks; it equals adapting and evaluating task by task
    (infeasible anchors included: the 6 x 6 random policies below violate the limit)."""
    from lowrank_lit.envs import SafeGridNav
    from lowrank_lit.methods.safe_meta_rl import (
        InfeasibleAnchorError,
        _softmax_gradient,
        adapt_tabular,
        hessian_free_meta_grad,
    )

    g = torch.Generator().manual_seed(0)
    for size in (6, 10):
        env = SafeGridNav(size=size)
        tasks = [0, 1, 2]
        phi = torch.randn(env.S, env.A, generator=g, dtype=torch.float64)
        pi = torch.softmax(phi, 1)
        ref = torch.zeros_like(phi)
        for t in tasks:
            try:
                pi1 = adapt_tabular(env, pi, t, 0.1, 0.1, mode)[0]
            except InfeasibleAnchorError:
                pi1 = pi
            er, _, occ = env.evaluate(pi1, t)
            ref += _softmax_gradient(occ, pi1, er.A, env.gamma) / len(tasks)
        got, _ = hessian_free_meta_grad(env, phi, tasks, 0.1, 0.1, mode)
        torch.testing.assert_close(got, ref, rtol=0, atol=F64)
