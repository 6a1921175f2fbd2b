"""What/how continual learning (paper 15), the pieces built so far: the cognitive tasks, the composed low-rank
RNN (properties 1, 2, 7), the epoch HMM's filtering and transitions (4, 5) and online vocabulary (6), bad inputs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lowrank_lit.data.cognitive import EPOCHS, TASKS, make_trials, response_accuracy
from lowrank_lit.methods.lowrank_rnn_cl import ComposedLowRankRNN, EpochHMM
from tests.tolerances import F64


def _onehot(k: int, B: int, T: int, K: int) -> torch.Tensor:
    c = torch.zeros(B, T, K)
    c[..., k] = 1
    return c


def test_tasks_are_built_from_the_shared_epochs():
    g = torch.Generator().manual_seed(0)
    tr = make_trials("MemoryAnti", 4, g, noise=0.0)
    assert tr["inputs"].shape == (4, 55, 3) and tr["targets"].shape == (4, 55, 3)
    seq = tr["epochs"][0].tolist()
    assert [EPOCHS[e] for e, _ in itertools.groupby(seq)] == list(TASKS["MemoryAnti"])
    r = tr["epochs"][0] == EPOCHS.index("R_anti")
    torch.testing.assert_close(tr["targets"][0, r, 1], -tr["theta"][0].cos().expand(int(r.sum())))
    assert response_accuracy(tr["targets"], tr["targets"], tr["epochs"]) == 1.0
    assert response_accuracy(-tr["targets"], tr["targets"], tr["epochs"]) == 0.0
    g2 = torch.Generator().manual_seed(0)
    assert torch.equal(make_trials("MemoryAnti", 4, g2, noise=0.0)["inputs"], tr["inputs"])
    with pytest.raises(ValueError, match="task='Go'; allowed: DelayPro"):
        make_trials("Go", 1, g)


def test_one_hot_context_is_one_component_and_mixing_is_linear():
    torch.manual_seed(0)
    net = ComposedLowRankRNN(n_units=16, rank=2, max_components=4, alpha=1.0, w0_gain=0.8).double()
    h = torch.randn(3, 16, dtype=torch.float64)
    s = torch.randn(3, 1, 3, dtype=torch.float64)
    with torch.no_grad():
        net.b.normal_()
    # alpha = 1: one step is h1 = (W0 + U_k V_k^T) tanh(h0) + W_in s + b_k
    for k in range(4):
        out = net(s, _onehot(k, 3, 1, 4).double(), h0=h)
        h1 = torch.tanh(h) @ (net.W0 + net.component(k)).T + s[:, 0] @ net.W_in.T + net.b[k]
        torch.testing.assert_close(out[:, 0], torch.tanh(h1) @ net.W_out.T)
    # the pre-activation is linear in the context
    c = torch.tensor([0.3, 0.7, 0.0, 0.0], dtype=torch.float64).expand(3, 1, 4)
    mix = torch.tanh(h) @ (net.W0 + 0.3 * net.component(0) + 0.7 * net.component(1)).T + s[:, 0] @ net.W_in.T + 0.3 * net.b[0] + 0.7 * net.b[1]
    torch.testing.assert_close(net(s, c, h0=h)[:, 0], torch.tanh(mix) @ net.W_out.T)
    assert int(torch.linalg.matrix_rank(net.component(2))) <= 2


def test_inactive_components_get_zero_gradient_and_new_ones_change_nothing():
    torch.manual_seed(1)
    net = ComposedLowRankRNN(n_units=16, rank=2, max_components=5)
    x = torch.randn(2, 6, 3)
    c = torch.zeros(2, 6, 5)
    c[..., 0], c[:, 3:, 0], c[:, 3:, 2] = 1, 0.4, 0.6
    out = net(x, c)
    out.square().sum().backward()
    for k in (1, 3, 4):
        assert net.U.grad[k].abs().sum() == 0 and net.V.grad[k].abs().sum() == 0 and net.b.grad[k].abs().sum() == 0
    assert net.U.grad[0].abs().sum() > 0 and net.U.grad[2].abs().sum() > 0
    # a component added later (new values in an unused slot) leaves these contexts' outputs unchanged
    with torch.no_grad():
        net.U[4].normal_()
        net.V[4].normal_()
        net.b[4].normal_()
    torch.testing.assert_close(net(x, c), out.detach())


def _brute_force_filter(ll: torch.Tensor, lam: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    T, K = ll.shape
    post = torch.zeros(T, K, dtype=torch.float64)
    for t in range(T):
        for path in itertools.product(range(K), repeat=t + 1):
            p = init[path[0]] * ll[0, path[0]].exp()
            for i in range(1, t + 1):
                p = p * lam[path[i - 1], path[i]] * ll[i, path[i]].exp()
            post[t, path[-1]] += p
        post[t] /= post[t].sum()
    return post


def test_filtering_matches_brute_force_and_rows_sum_to_one():
    hmm = EpochHMM(obs_dim=4, n_inputs=2, max_components=3)
    hmm.K = 2
    hmm.A[:2] = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    hmm.var[:2] = 0.5
    hmm.trans["t"] = torch.zeros(3, 3, dtype=torch.float64)
    hmm.trans["t"][0, 1] = 5
    hmm.init["t"] = torch.tensor([3.0, 1.0, 0.0], dtype=torch.float64)
    s = torch.randn(3, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = hmm.filter(s, 0.7, "t")
    assert got.shape == (3, 3) and bool((got[:, 2] == 0).all())
    q = torch.cat([s, torch.zeros(3, 2, dtype=torch.float64)], 1)
    want = _brute_force_filter(hmm.loglik(q, 0.7, slice(0, 2)), hmm.transition_matrix("t"), hmm._initial("t"))
    torch.testing.assert_close(got[:, :2], want, atol=F64, rtol=0)
    lam = hmm.transition_matrix("t")
    torch.testing.assert_close(lam.sum(1), torch.ones(2, dtype=torch.float64))
    # a never-seen transition (1 -> 0) keeps only its prior mass eps / (kappa + eps)
    assert float(lam[1, 0]) == pytest.approx(hmm.eps / (hmm.kappa + hmm.eps))
    with pytest.raises(KeyError, match="unknown task 'u'; known: t"):
        hmm.filter(s, 0.7, "u")


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_vocabulary_grows_3_4_5_5_and_epochs_match(noise):
    """The noise-free (and the noisy) task stream: vocabulary 3, 4, 5, 5 over DelayPro, DelayAnti, MemoryPro,
    MemoryAnti; the inferred epochs match the true ones up to relabelling on >= 95 % of the steps."""
    g = torch.Generator().manual_seed(0)
    hmm = EpochHMM()
    sizes, pairs = [], []
    for task in TASKS:
        tr = make_trials(task, 20, g, noise=noise)
        for i in range(20):
            path = hmm.observe_trial(torch.cat([tr["inputs"][i], tr["targets"][i]], 1), float(tr["theta"][i]), task)
            if i >= 10:
                pairs += list(zip(path, tr["epochs"][i].tolist(), strict=True))
        sizes.append(hmm.vocab_size)
    assert sizes == [3, 4, 5, 5]
    # best relabelling: each inferred epoch to its most frequent true epoch
    from collections import Counter

    best = {k: Counter(t for p, t in pairs if p == k).most_common(1)[0][0] for k in {p for p, _ in pairs}}
    assert sum(best[p] == t for p, t in pairs) / len(pairs) >= 0.95
    assert len(set(best.values())) == 5


def test_bad_inputs():
    with pytest.raises(ValueError, match="rank=0"):
        ComposedLowRankRNN(rank=0)
    with pytest.raises(ValueError, match="rank=65"):
        ComposedLowRankRNN(n_units=64, rank=65)
    with pytest.raises(ValueError, match="alpha=0"):
        ComposedLowRankRNN(alpha=0)
    with pytest.raises(ValueError, match="max_components=0"):
        ComposedLowRankRNN(max_components=0)
    net = ComposedLowRankRNN(n_units=8, max_components=3)
    x = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="context of shape"):
        net(x, torch.ones(2, 4, 2) / 2)
    with pytest.raises(ValueError, match="negative"):
        net(x, torch.tensor([1.5, -0.5, 0.0]).expand(2, 4, 3))
    with pytest.raises(ValueError, match="sum to 1"):
        net(x, torch.full((2, 4, 3), 0.5))
    with pytest.raises(ValueError, match="n_in=3"):
        net(torch.zeros(2, 4, 5), _onehot(0, 2, 4, 3))
    with pytest.raises(ValueError, match="NaN"):
        net(torch.full((2, 4, 3), math.nan), _onehot(0, 2, 4, 3))
    hmm = EpochHMM(max_components=2)
    g = torch.Generator().manual_seed(0)
    tr = make_trials("DelayPro", 12, g, noise=0.0)
    with pytest.raises(RuntimeError, match="exceed max_components=2"):
        for i in range(12):
            hmm.observe_trial(torch.cat([tr["inputs"][i], tr["targets"][i]], 1), float(tr["theta"][i]), "DelayPro")
    with pytest.raises(ValueError, match="NaN"):
        EpochHMM().observe_trial(torch.full((5, 6), math.nan), 0.0, "DelayPro")
    with pytest.raises(ValueError, match="obs_dim=6"):
        EpochHMM().observe_trial(torch.zeros(5, 4), 0.0, "DelayPro")


def test_state_holding_diagnostics():
    from lowrank_lit.methods.lowrank_rnn_cl import state_holding

    g = torch.Generator().manual_seed(0)
    tr = make_trials("MemoryPro", 200, g, 0.0)
    n, T = tr["epochs"].shape
    code = torch.stack([tr["theta"].cos(), tr["theta"].sin()], 1)  # (n, 2)
    basis = torch.randn(2, 16, generator=g)
    held = (code @ basis)[:, None].expand(n, T, 16).clone()  # the stimulus code, held through every step
    d = state_holding(held, tr["epochs"], tr["theta"])
    assert d["hold_distance"] == pytest.approx(0.0, abs=F64)
    assert d["decode_delay"] == 1.0 and d["decode_transfer"] == 1.0
    # a rotation of the code during the delay: still decodable at the same step, not by the stimulus-step decoder
    m = tr["epochs"][0] == EPOCHS.index("M")
    rotated = held.clone()
    rot = torch.tensor([[0.0, -1.0], [1.0, 0.0]])
    rotated[:, m] = (code @ rot @ basis)[:, None]
    d = state_holding(rotated, tr["epochs"], tr["theta"])
    assert d["hold_distance"] > 0.5
    assert d["decode_delay"] == 1.0 and d["decode_transfer"] < 0.2
    # forgotten: the delay state carries no stimulus information
    lost = held.clone()
    lost[:, m] = torch.randn(n, 16, generator=g)[:, None]
    assert state_holding(lost, tr["epochs"], tr["theta"])["decode_delay"] < 0.3
    assert state_holding(held[:, :40], make_trials("DelayPro", 200, g)["epochs"], tr["theta"]) == {}


def test_hold_loss_pulls_the_memory_states_to_the_stimulus_state():
    """0 for a state held exactly, > 0 for one that moves in the delay, None without a memory epoch; the
    gradient reaches the memory epoch's component and not the stimulus target (detached)."""
    from lowrank_lit.methods.lowrank_rnn_cl import WhatHowModule, hold_loss

    with pytest.raises(ValueError, match="hold_weight=-1.0; allowed: >= 0"):
        WhatHowModule(hold_weight=-1.0)
    tr = make_trials("MemoryPro", 8, torch.Generator().manual_seed(1))
    n, T = tr["epochs"].shape
    held = torch.randn(n, 1, 5).expand(n, T, 5)
    assert float(hold_loss(held, tr["epochs"])) == pytest.approx(0.0, abs=F64)
    moved = held.clone()
    moved[:, tr["epochs"][0] == EPOCHS.index("M")] *= 2  # r_t = 2 r_S: ||r_S||^2 / ||r_S||^2 = 1
    assert float(hold_loss(moved, tr["epochs"])) == pytest.approx(1.0)
    assert hold_loss(held[:, :40], make_trials("DelayPro", 8, torch.Generator())["epochs"]) is None
    rnn = ComposedLowRankRNN(n_units=16, max_components=4, seed=0)
    ctx = torch.nn.functional.one_hot(tr["epochs"].clamp_max(3), 4).float()
    out, states = rnn(tr["inputs"], ctx, return_states=True)
    torch.testing.assert_close(out, rnn(tr["inputs"], ctx))
    torch.testing.assert_close(out, states @ rnn.W_out.T)
    hold = hold_loss(states, tr["epochs"])
    hold.backward()
    assert float(hold) > 0 and float(rnn.U.grad[2].abs().sum()) > 0  # the memory epoch's component (M = index 2)
