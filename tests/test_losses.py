"""Advantage estimators and surrogates against hand-computed values and gradients."""

import math

import pytest
import torch

from workbench.trainer.losses import AdvantageInput, aggregate, get_advantage, get_surrogate

MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])


def adv(name, rewards, groups, **kw):
    return get_advantage(name)(AdvantageInput(torch.tensor(rewards), torch.tensor(groups), MASK, **kw))


def test_group_estimators():
    r, g = [1.0, 0.0, 0.0, 2.0], [0, 0, 1, 1]
    # group 0: mean .5, std (unbiased) .7071; group 1: mean 1, std 1.4142
    a = adv("grpo", r, g)
    assert torch.allclose(a[:, 0], torch.tensor([0.7071, -0.7071, -0.7071, 0.7071]), atol=1e-3)
    assert a[1, 1] == 0  # masked position
    assert torch.allclose(adv("dr_grpo", r, g)[:, 0], torch.tensor([0.5, -0.5, -1.0, 1.0]))
    assert torch.allclose(adv("rloo", r, g)[:, 0], torch.tensor([1.0, -1.0, -2.0, 2.0]))
    rpp = adv("reinforce_pp_baseline", r, g)[:, 0]
    centred, tokens = torch.tensor([0.5, -0.5, -1.0, 1.0]), MASK.sum(-1).float()
    # divided by the root mean square over the trainable tokens (each row's centred reward once per token)
    assert torch.allclose(rpp, centred / ((tokens * centred ** 2).sum() / tokens.sum()).sqrt(), atol=1e-4)


def test_reinforce_pp_baseline_whitens_over_trainable_tokens():
    """REINFORCE++-baseline's batch std is over tokens (the paper's, OpenRLHF's, verl's): over
    episodes, long wrong answers made every advantage 1.2x too small, and episodes that train
    nothing (masked as truncated, their reward still in their group's mean) inflated them."""
    rewards, groups = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    lengths = torch.tensor([10.0, 100, 100, 100, 20, 30, 60, 80])
    a = get_advantage("reinforce_pp_baseline")(AdvantageInput(rewards, groups, torch.ones(8, 1), tokens=lengths))[:, 0]
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5], dtype=torch.float64)
    per_token = centred.repeat_interleave(lengths.long())
    assert torch.allclose(a.double(), centred / per_token.pow(2).mean().sqrt(), atol=1e-5)
    assert a[0] > 1.95  # (over episodes: 1.60)
    # six masked episodes (no token) with the two trained ones in a group: the same advantages as without them
    # in the std (their rewards only in the group's mean)
    rewards, groups = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 1, 0]), torch.tensor([0] * 8 + [1, 1])
    tokens = torch.tensor([5.0, 5, 0, 0, 0, 0, 0, 0, 5, 5])
    a = get_advantage("reinforce_pp_baseline")(AdvantageInput(rewards, groups, torch.ones(10, 1), tokens=tokens))[:, 0]
    centred = torch.tensor([0.875, -0.125, 0.5, -0.5], dtype=torch.float64)
    trained = a[[0, 1, 8, 9]].double()
    assert torch.allclose(trained, centred / centred.pow(2).mean().sqrt(), atol=1e-5)
    # one trained episode among masked ones: its centred reward alone, scaled to 1 (the std about the
    # token mean was 0 there, and its advantage 1 / eps)
    one = get_advantage("reinforce_pp_baseline")(AdvantageInput(torch.tensor([1.0, 0, 0, 0]), torch.tensor([0] * 4),
                                                                torch.ones(4, 1), tokens=torch.tensor([5.0, 0, 0, 0])))
    assert one[0, 0] == pytest.approx(1.0, abs=1e-5)
    # nothing trainable at all: no advantage (no NaN)
    assert (get_advantage("reinforce_pp_baseline")(AdvantageInput(rewards, groups, torch.ones(10, 1),
                                                                   tokens=torch.zeros(10))) == 0).all()


@pytest.mark.parametrize("reward,n", [(0.7, 8), (0.7, 16), (0.1, 7), (0.9, 32), (1 / 3, 5)])
def test_a_group_of_equal_rewards_has_no_advantage(reward, n):
    """Equal non-integer rewards teach nothing. In float32 the group's mean was off by ~1e-8 and
    its std ~1e-8, so grpo gave every episode the same advantage (+0.056 at 8 x 0.7), its sign
    set by rounding. A second group with a spread keeps its advantages."""
    # (a second group of 3, whose centred rewards -2/3, 1/3, 1/3 do not sum to 0 in floating point:
    # reinforce_pp_baseline subtracted that rounding, -5e-17, from every advantage)
    rewards = torch.tensor([reward] * n + [0.0, 1.0, 1.0], dtype=torch.float32)
    groups = torch.tensor([0] * n + [1, 1, 1])
    x = AdvantageInput(rewards, groups, torch.ones(n + 3, 3))
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        a = get_advantage(name)(x)
        assert a.dtype == torch.float32 and (a[:n] == 0).all(), (name, a[:n, 0])
        assert (a[n:, 0] != 0).all(), name


def test_singleton_group_has_no_leave_one_out_baseline():
    x = AdvantageInput(torch.tensor([3.0]), torch.tensor([7]), torch.tensor([[1, 1]]))
    assert get_advantage("rloo")(x).abs().sum() == 0


def test_distillation_advantage_is_teacher_minus_student():
    student = torch.log(torch.tensor([[0.5, 0.5], [0.25, 1.0], [0.5, 0.5], [0.5, 0.5]]))
    teacher = torch.log(torch.tensor([[0.5, 1.0], [0.5, 1.0], [0.5, 0.5], [0.25, 0.5]]))
    a = adv("distill", [0.0] * 4, [0] * 4, logprobs=student, teacher_logprobs=teacher)
    assert torch.allclose(a, (teacher - student) * MASK)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        adv("distill", [0.0] * 4, [0] * 4)


def test_ppo_clip_values_and_clipped_gradient():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.5]])).requires_grad_()  # ratios 1.5, 1.0
    A, w, m = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), torch.ones(1, 2)
    loss = get_surrogate("ppo_clip")(new, old, A, w, m)
    assert torch.allclose(loss, torch.tensor([[-1.2, 1.0]]))
    loss.sum().backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] == pytest.approx(1.0)  # clipped token has no gradient


def test_cispo_keeps_gradient_of_clipped_tokens():
    old = torch.log(torch.tensor([[0.5]]))
    new = torch.log(torch.tensor([[0.75]])).requires_grad_()
    loss = get_surrogate("cispo")(new, old, torch.tensor([[1.0]]), torch.ones(1, 1), torch.ones(1, 1))
    loss.sum().backward()
    assert new.grad[0, 0] == pytest.approx(-1.2)  # weight capped at 1.2, gradient kept


def test_gspo_uses_the_sequence_ratio():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    A = torch.tensor([[2.0, 2.0]])
    loss = get_surrogate("gspo")(new, old, A, torch.ones(1, 2), torch.ones(1, 2))
    assert torch.allclose(loss, torch.tensor([[-2.0, -2.0]]))
    loss.sum().backward()
    assert torch.allclose(new.grad, torch.tensor([[-2.0, -2.0]]))


def test_gspo_weighs_each_sequence_once_unless_an_aggregation_is_set():
    """GSPO's objective is a mean over sequences: under token_mean (the default for every other
    surrogate) a 6-token sequence pulled 3x as hard as a 2-token one of the same advantage."""
    from workbench.trainer.fsdp import TrainerConfig
    from workbench.trainer.losses import aggregation_weights

    cfg = TrainerConfig(surrogate="gspo")
    assert cfg.loss_aggregation == "seq_mean_token_mean" and TrainerConfig().loss_aggregation == "token_mean"
    assert TrainerConfig(surrogate="gspo", aggregation="token_mean").loss_aggregation == "token_mean"  # set: kept
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    lp = torch.full((2, 6), math.log(0.5), requires_grad=True)
    loss = get_surrogate("gspo")(lp, lp.detach(), torch.ones(2, 6), torch.ones(2, 6), mask.float())
    (loss * aggregation_weights(mask, cfg.loss_aggregation)).sum().backward()
    per_sequence = lp.grad.sum(-1)  # each sequence's pull on its mean log-prob
    assert torch.allclose(per_sequence, torch.tensor([-0.5, -0.5]))


def test_kl_penalty_gradients_in_expectation():
    """The penalty is the estimator on tokens sampled from pi, the samples held fixed: its expected
    gradient, exactly over a 6-token vocabulary, is grad KL(pi || ref) for k2, grad KL(ref || pi)
    for k3 (the forward KL: GRPO's penalty) and 0 for k1, which TrainerConfig refuses as a penalty."""
    from workbench.trainer.fsdp import TrainerConfig
    from workbench.trainer.losses import kl_to_reference

    torch.manual_seed(0)
    theta, ref = torch.randn(6, requires_grad=True), torch.log_softmax(torch.randn(6), 0)

    def grad(f):
        return torch.autograd.grad(f(), theta)[0]

    logp = lambda: torch.log_softmax(theta, 0)  # noqa: E731
    pi = logp().exp().detach()
    expected = {est: grad(lambda: (pi * kl_to_reference(est, logp(), ref, torch.ones(6))).sum()) for est in ("k1", "k2", "k3")}
    reverse = grad(lambda: (logp().exp() * (logp() - ref)).sum())
    forward = grad(lambda: (ref.exp() * (ref - logp())).sum())
    assert torch.allclose(expected["k2"], reverse, atol=1e-6) and not torch.allclose(expected["k2"], forward, atol=1e-3)
    assert torch.allclose(expected["k3"], forward, atol=1e-6)
    assert torch.allclose(expected["k1"], torch.zeros(6), atol=1e-6)
    with pytest.raises(ValueError, match="'k1' as a penalty"):
        TrainerConfig(kl_coef=0.1, kl_estimator="k1")
    TrainerConfig(kl_coef=0.0, kl_estimator="k1")  # no penalty: fine


def test_weights_from_correction_scale_and_drop_tokens():
    old = torch.zeros(1, 3)
    new = torch.zeros(1, 3, requires_grad=True)
    w = torch.tensor([[1.0, 0.5, 0.0]])
    loss = get_surrogate("ppo_clip")(new, old, torch.ones(1, 3), w, torch.ones(1, 3))
    assert torch.allclose(loss, torch.tensor([[-1.0, -0.5, 0.0]]))


def test_aggregations():
    losses = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    m = torch.tensor([[1, 1], [1, 0]])
    assert aggregate(losses, m, "token_mean") == pytest.approx(2.0)
    assert aggregate(losses, m, "seq_mean_token_mean") == pytest.approx(2.0)
    assert aggregate(losses, m, "constant", max_len=4) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(losses, m, "mean")
    with pytest.raises(ValueError, match="unknown surrogate"):
        get_surrogate("ppo")


def test_kl_estimators_against_hand_values():
    from workbench.trainer.losses import KL_ESTIMATORS

    d = torch.tensor([0.0, math.log(2.0), -math.log(2.0)])  # log pi - log pi_ref
    assert torch.allclose(KL_ESTIMATORS["k1"](d), d)
    assert torch.allclose(KL_ESTIMATORS["k2"](d), 0.5 * d * d)
    # k3 = pi_ref/pi - 1 - log(pi_ref/pi): 0 at d = 0; 0.5 - 1 + ln 2 at d = ln 2; 2 - 1 - ln 2 at d = -ln 2
    assert torch.allclose(KL_ESTIMATORS["k3"](d), torch.tensor([0.0, math.log(2.0) - 0.5, 1 - math.log(2.0)]))
    assert (KL_ESTIMATORS["k3"](torch.linspace(-3, 3, 61)) >= -1e-7).all()  # never negative (up to rounding)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_stays_finite_where_nothing_trains(estimator):
    """A prompt token the policy puts ~93 nats under the reference: k3's e^-d overflows there, and
    masking after the estimator (inf * 0) made the loss and every gradient NaN."""
    from workbench.trainer.losses import KL_ESTIMATORS, kl_to_reference

    lp = torch.tensor([[-95.0, -1.0]], requires_grad=True)
    ref, mask = torch.tensor([[-2.0, -1.2]]), torch.tensor([[0, 1]])
    kl = kl_to_reference(estimator, lp, ref, mask)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    assert kl[0, 0] == 0 and lp.grad[0, 0] == 0  # nothing from the untrained token
    assert torch.allclose(kl[0, 1], KL_ESTIMATORS[estimator](torch.tensor(0.2)))  # the trained one as before


def test_a_row_the_gate_dropped_adds_no_kl_penalty_and_no_nan():
    """The KL penalty is weighted by the correction's weight, 0 on a row the staleness gate
    dropped. That row, sampled versions ago, may sit ~93 nats under the reference: k3's e^-d was
    inf there and inf * 0 NaN, the gradient norm NaN and the whole update skipped."""
    from workbench.correction import CorrectionConfig, correction_weights
    from workbench.trainer.losses import kl_penalty, kl_to_reference

    lp = torch.tensor([[-1.0, -0.5], [-95.0, -1.0]], requires_grad=True)  # row 1: far under the reference
    ref, mask = torch.tensor([[-1.2, -0.7], [-2.0, -1.2]]), torch.ones(2, 2)
    corr = correction_weights(lp.detach(), lp.detach() - 0.01, mask, torch.tensor([[10, 10], [4, 4]]), 10,
                              CorrectionConfig.tis(max_staleness=4))
    assert corr.token_keep.tolist() == [[True, True], [False, False]]  # row 1 is 6 versions old: gated
    assert not torch.isfinite(kl_to_reference("k3", lp, ref, mask)).all()  # (the estimate itself overflows there)
    penalty = kl_penalty("k3", lp, ref, mask, corr.weights)
    penalty.sum().backward()
    assert torch.isfinite(penalty).all() and torch.isfinite(lp.grad).all()
    assert penalty[1].tolist() == [0.0, 0.0] and lp.grad[1].tolist() == [0.0, 0.0] and (lp.grad[0] != 0).all()


def test_surrogate_arguments_are_checked_when_the_config_is_made():
    """cispo took any keyword and dropped it (eps_low, as verl and MiniMax name a lower clip, did
    nothing); ppo_clip and gspo raised at the first train step, after a rollout."""
    from workbench.trainer.fsdp import TrainerConfig

    with pytest.raises(ValueError, match=r"do not fit surrogate 'cispo' .* it takes \['eps_high'\]"):
        TrainerConfig(surrogate="cispo", surrogate_kwargs={"eps_low": 0.2})
    with pytest.raises(ValueError, match=r"do not fit surrogate 'ppo_clip' .* it takes \['eps_low', 'eps_high'\]"):
        TrainerConfig(surrogate_kwargs={"eps": 0.2})
    assert TrainerConfig(surrogate="gspo", surrogate_kwargs={"eps_low": 1e-3}).surrogate_kwargs == {"eps_low": 1e-3}
    # their values as numbers: YAML reads 3e-4 as text, which failed in the ranks at the first step
    assert TrainerConfig(surrogate="gspo", surrogate_kwargs={"eps_low": "3e-4"}).surrogate_kwargs == {"eps_low": 3e-4}
    for bad in ("wide", True, None):
        with pytest.raises(ValueError, match=r"surrogate_kwargs\['eps_high'\] must be a number \(surrogate 'ppo_clip'\)"):
            TrainerConfig(surrogate_kwargs={"eps_high": bad})
    # clip widths out of range: a negative eps_low left every negative-advantage token on clamp's
    # constant (no gradient: a run learning from its successes alone); CISPO's eps_high < -1 reversed all
    for surrogate, kwargs in (("ppo_clip", {"eps_low": -0.2}), ("ppo_clip", {"eps_high": -0.3}), ("gspo", {"eps_low": 1.0}),
                              ("cispo", {"eps_high": -1.5}), ("ppo_clip", {"eps_low": "-0.2"})):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=rf"surrogate_kwargs\['{name}'\] is a clip width: it must be >= 0"):
            TrainerConfig(surrogate=surrogate, surrogate_kwargs=kwargs)
    assert TrainerConfig(surrogate_kwargs={"eps_low": 0, "eps_high": 10}).surrogate_kwargs == {"eps_low": 0, "eps_high": 10}
    # a NaN kl_coef passed `< 0` and read as 0 (the penalty off without a word); the trainer's temperature divides
    for field, bad in (("kl_coef", float("nan")), ("kl_coef", float("inf")), ("temperature", -0.7), ("temperature", 0.0)):
        with pytest.raises(ValueError, match=rf"TrainerConfig.{field} must be a finite number"):
            TrainerConfig(**{field: bad})
