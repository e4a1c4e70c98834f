"""Window control: γ fills the round trip when drafts are accepted, shrinks when they are not."""

from __future__ import annotations

import random

import pytest

from dsd.node.head.window import WindowController


def feed(wc: WindowController, rounds: int, *, accept_all: bool, draft_s: float, round_s: float) -> int:
    """Play `rounds` windows at the controller's own γ; return the final γ."""
    for _ in range(rounds):
        g = wc.next_gamma()
        wc.observe(gamma=g, accepted=g if accept_all else 0, draft_s_per_token=draft_s, round_s=round_s)
    return wc.next_gamma()


def test_initial_gamma_before_any_measurement() -> None:
    assert WindowController(initial=5).next_gamma() == 5
    assert WindowController(gamma_max=2).next_gamma() == 2  # the default initial is clamped


def test_fixed_override_is_respected() -> None:
    wc = WindowController(gamma=7, gamma_max=4, initial=2)
    assert feed(wc, 20, accept_all=False, draft_s=0.01, round_s=0.01) == 7
    assert feed(wc, 20, accept_all=True, draft_s=0.0001, round_s=1.0) == 7


def test_grows_to_fill_the_round_trip_when_accepted() -> None:
    wc = WindowController(gamma_max=16, initial=2)
    g = feed(wc, 40, accept_all=True, draft_s=0.005, round_s=0.04)
    assert 7 <= g <= 9, g  # 0.04 s of round trip holds 8 drafts of 5 ms
    assert g * 0.005 <= 0.04 * 1.2
    wc2 = WindowController(gamma_max=16, initial=2)
    assert feed(wc2, 40, accept_all=True, draft_s=0.001, round_s=0.5) == 16  # bounded above


def test_shrinks_when_acceptance_is_low() -> None:
    wc = WindowController(gamma_max=16, initial=8)
    feed(wc, 30, accept_all=True, draft_s=0.001, round_s=0.1)
    assert wc.next_gamma() >= 12
    g = feed(wc, 30, accept_all=False, draft_s=0.001, round_s=0.1)
    assert g <= 2 and wc.alpha < 0.1


def test_overlap_fills_the_trip_and_beats_draft_then_wait() -> None:
    """When windows are (nearly) always accepted, DSD's drafting hides behind the trip: it picks the
    window whose pre-draft — the guessed bonus token plus γ drafts, (γ+1)·d — just fills the round
    (0.1 s / 0.01 s per token: γ = 9), and its expected token rate is higher than draft-then-wait's
    at that controller's own choice."""
    hidden = WindowController(overlap=True)
    waited = WindowController(overlap=False)
    for wc in (hidden, waited):
        for _ in range(30):
            g = wc.next_gamma()
            wc.observe(gamma=g, accepted=g, draft_s_per_token=0.01, round_s=0.1)
    assert hidden.next_gamma() == 9

    def rate(wc: WindowController) -> float:
        g = wc.next_gamma()
        return wc.expected_tokens(wc.alpha, g) / wc._round_time(g)

    assert rate(hidden) > 1.5 * rate(waited)


def test_overlap_only_pays_when_the_whole_window_is_accepted() -> None:
    """With rejections the pre-drafted window is usually lost: DSD's expected round time approaches
    draft-then-wait's as the window grows, so it must not pick a longer window than at high acceptance."""
    lossy = WindowController(overlap=True)
    for _ in range(30):
        g = lossy.next_gamma()
        lossy.observe(gamma=g, accepted=int(0.6 * g), draft_s_per_token=0.01, round_s=0.1)
    sure = WindowController(overlap=True)
    for _ in range(30):
        sure.observe(gamma=sure.next_gamma(), accepted=sure.next_gamma(), draft_s_per_token=0.01, round_s=0.1)
    assert lossy.next_gamma() < sure.next_gamma()
    g = 8
    assert lossy._round_time(g) > max(0.1, g * 0.01)  # the expected cost includes unhidden redrafting


def test_always_within_bounds_under_random_measurements() -> None:
    rng = random.Random(0)
    wc = WindowController(gamma_min=2, gamma_max=9, initial=3)
    for _ in range(500):
        g = wc.next_gamma()
        assert 2 <= g <= 9
        wc.observe(
            gamma=g,
            accepted=rng.randint(0, g),
            draft_s_per_token=rng.choice([0.0, 1e-4, 0.01, 0.3]),
            round_s=rng.choice([0.0, 0.001, 0.05, 2.0]),
        )


def test_acceptance_estimate_is_the_truncated_geometric_mle() -> None:
    wc = WindowController(decay=0.0, prior_weight=0.0)
    wc.observe(gamma=4, accepted=2, draft_s_per_token=0.01, round_s=0.1)
    assert wc.alpha == pytest.approx(2 / 3)  # 2 successes, then 1 failure
    wc.observe(gamma=4, accepted=4, draft_s_per_token=0.01, round_s=0.1)
    assert wc.alpha == 1.0  # no failure observed


def test_expected_tokens_formula() -> None:
    assert WindowController.expected_tokens(0.0, 5) == 1.0
    assert WindowController.expected_tokens(1.0, 5) == 6.0
    assert WindowController.expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"gamma": 0}, "fixed gamma"),
        ({"gamma_min": 0}, "gamma_min"),
        ({"gamma_min": 5, "gamma_max": 4}, "gamma_min"),
        ({"initial": 0}, "initial"),
        ({"decay": 1.0}, "decay"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        WindowController(**kwargs)


def test_bad_observations_are_refused() -> None:
    wc = WindowController()
    with pytest.raises(ValueError, match="accepted"):
        wc.observe(gamma=3, accepted=4, draft_s_per_token=0.1, round_s=0.1)
    with pytest.raises(ValueError, match="round_s"):
        wc.observe(gamma=3, accepted=1, draft_s_per_token=0.1, round_s=float("nan"))


def test_window_shrinks_when_verification_compute_grows_with_the_window() -> None:
    """On CPU peers a window's round time grows with its size; the fitted R(γ) = a + b·(γ+1)
    must pull γ below what a size-independent round time would choose."""
    flat, sloped = WindowController(gamma_max=16), WindowController(gamma_max=16)
    for g in (2, 4, 8, 12, 6, 10, 3, 9):
        flat.observe(gamma=g, accepted=int(0.75 * g), draft_s_per_token=0.05, round_s=2.0)
        sloped.observe(gamma=g, accepted=int(0.75 * g), draft_s_per_token=0.05, round_s=1.0 + 0.4 * (g + 1))
    a, b = sloped.round_model()
    assert a == pytest.approx(1.0, abs=1e-6) and b == pytest.approx(0.4, abs=1e-6)
    assert flat.round_model()[1] == pytest.approx(0.0)
    assert sloped.next_gamma() < flat.next_gamma()


def test_round_time_matches_a_hand_computed_case() -> None:
    """T(γ) = P·max(R, (γ+1)·d) + (1 − P)·(R + γ·d), with P the measured ready share once observed."""
    wc = WindowController(overlap=True, decay=0.5)
    wc.observe(gamma=4, accepted=4, draft_s_per_token=0.05, round_s=0.2)  # first observation: taken as is
    wc.observe_ready(True)
    wc.observe_ready(False)  # EWMA with decay 0.5: 0.5
    assert wc.ready_share == 0.5
    r, d, g = 0.2, 0.05, 5
    assert abs(wc._round_time(g) - (0.5 * max(r, (g + 1) * d) + 0.5 * (r + g * d))) < 1e-12
    plain = WindowController(overlap=False)
    plain.observe(gamma=4, accepted=4, draft_s_per_token=0.05, round_s=0.2)
    assert abs(plain._round_time(g) - (r + g * d)) < 1e-12


def playing(alpha: float, rounds: int = 60, seed: int = 3) -> WindowController:
    """A controller that has seen `rounds` windows with per-draft acceptance `alpha` (50 ms trips, 5 ms drafts)."""
    rng = random.Random(seed)
    wc = WindowController(gamma_max=12, initial=4)
    for _ in range(rounds):
        g = max(1, wc.next_gamma())
        k = 0
        while k < g and rng.random() < alpha:
            k += 1
        wc.observe(gamma=g, accepted=k, draft_s_per_token=0.005, round_s=0.05 + 0.004 * (g + 1))
    return wc


def test_the_routes_load_narrows_windows_and_at_the_acceptance_rate_stops_drafting() -> None:
    wc = playing(0.8)
    free = wc.next_gamma()
    assert free >= 3 and wc.load == 0.0
    gammas = []
    for load in (0.0, 0.2, 0.5, 0.7, wc.alpha, 1.0, 3.0):
        wc.observe_load(load)
        gammas.append(wc.next_gamma())
    assert gammas[0] == free  # no load: the rule without it
    assert gammas == sorted(gammas, reverse=True) and gammas[2] < free, gammas  # narrower as the load grows
    assert gammas[-3:] == [0, 0, 0], gammas  # a row that costs the others more than it is likely to be worth: none
    wc.observe_load(0.0)
    assert wc.next_gamma() == free  # the load gone: back at once
    with pytest.raises(ValueError, match="load"):
        wc.observe_load(float("nan"))


def test_a_bet_goes_ahead_under_load_only_if_its_chance_pays_for_its_rows() -> None:
    wc = playing(0.8)
    assert wc.worth_ahead(0.05, 4)  # no load: the engine's own threshold decides alone
    wc.observe_load(0.3)
    e4 = wc.expected_tokens(wc.alpha, 4)
    assert wc.worth_ahead(0.9, 4)
    p_even = 5 * 0.3 / (e4 + 5 * 0.3)  # p·E(4) = (1 − p)·5·L
    assert not wc.worth_ahead(p_even - 0.01, 4) and wc.worth_ahead(p_even + 0.01, 4)
