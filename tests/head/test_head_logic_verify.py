"""Window verification: exact greedy cases, distributional exactness of the rejection-sampling rule (dsd-adaptive's;
the lossless modes' Gumbel-max rule: test_head_logic_coupled), stops."""

from __future__ import annotations

import random

import pytest
import torch
from support.sampling import chi2_pvalue

from dsd.node.head.sampling import SamplingParams, warp
from dsd.node.head.verify import Verdict, cut_at_stop, find_stop, stream_safe_length, verify_window

torch.set_num_threads(1)
GREEDY = SamplingParams()
NEG = float("-inf")




def logits_with_top(tops: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits [len(tops), V] whose argmax per row is the given token."""
    out = torch.zeros(len(tops), vocab)
    for i, t in enumerate(tops):
        out[i, t] = 5.0
    return out


# --- greedy ---------------------------------------------------------------------------------


def test_greedy_all_accepted_gets_bonus() -> None:
    v = verify_window(logits_with_top([3, 1, 4, 2]), [3, 1, 4], None, GREEDY, None)
    assert v == Verdict(accepted=3, next_token=2, tokens=[3, 1, 4, 2])


def test_greedy_first_rejected() -> None:
    v = verify_window(logits_with_top([3, 1, 4, 2]), [0, 1, 4], None, GREEDY, None)
    assert v == Verdict(accepted=0, next_token=3, tokens=[3])


def test_greedy_middle_rejected() -> None:
    v = verify_window(logits_with_top([3, 1, 4, 2]), [3, 0, 4], None, GREEDY, None)
    assert v == Verdict(accepted=1, next_token=1, tokens=[3, 1])
    v = verify_window(logits_with_top([3, 1, 4, 2]), [3, 1, 5], None, GREEDY, None)
    assert v == Verdict(accepted=2, next_token=4, tokens=[3, 1, 4])


def test_greedy_empty_window_is_plain_decoding() -> None:
    assert verify_window(logits_with_top([6]), [], None, GREEDY, None).tokens == [6]


def test_greedy_tie_follows_torch_argmax_and_ignores_q() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.0, 0.0, 3.0], [0.0] * 6])
    q = torch.full((1, 6), 1 / 6)
    # Token 5 ties with 2, but argmax (what the target would emit) is 2: reject.
    assert verify_window(logits, [5], q, GREEDY, None).tokens == [2]
    assert verify_window(logits, [2], q, GREEDY, None).tokens == [2, 0]


def test_greedy_matches_target_argmax_decoding_on_random_windows() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        gamma = rng.randint(0, 6)
        logits = torch.randn(gamma + 1, 5, generator=gen)
        best = torch.argmax(logits, -1).tolist()
        drafts = [b if rng.random() < 0.7 else rng.randrange(5) for b in best[:gamma]]
        k = 0
        while k < gamma and drafts[k] == best[k]:
            k += 1
        v = verify_window(logits, drafts, None, GREEDY, None)
        assert v.accepted == k and v.tokens == best[: k + 1]


# --- input validation -------------------------------------------------------------------------


def test_bad_windows_are_refused_with_clear_errors() -> None:
    logits = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="gamma\\+1 = 2 rows"):
        verify_window(logits, [1], None, GREEDY, None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_window(logits, [1, 8], None, GREEDY, None)
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify_window(logits, [1, 2], torch.zeros(2, 7), GREEDY, None)
    with pytest.raises(ValueError, match="tau must have shape"):
        verify_window(logits, [1, 2], None, GREEDY, None, tau=torch.zeros(3))
    with pytest.raises(ValueError, match="tau values"):
        verify_window(logits, [1, 2], None, GREEDY, None, tau=torch.tensor([0.0, 1.5]))
    with pytest.raises(ValueError, match="2-D"):
        verify_window(torch.zeros(8), [], None, GREEDY, None)
    with pytest.raises(ValueError, match="NaN"):
        verify_window(torch.full((1, 8), float("nan")), [], None, GREEDY, None)
    q = torch.tensor([[0.0, 0.0, 1.0] + [0.0] * 5, [0.125] * 8])
    with pytest.raises(ValueError, match="draft probability"):
        verify_window(logits, [1, 2], q, SamplingParams(temperature=1.0), torch.Generator())


# --- sampling: the emitted distribution is the target's ----------------------------------------


def _first_token_counts(
    target_logits: torch.Tensor,
    q: torch.Tensor | None,
    params: SamplingParams,
    draws: int,
    seed: int,
    fixed_drafts: list[int] | None = None,
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    gamma, vocab = target_logits.shape[0] - 1, target_logits.shape[1]
    if q is not None:
        cols = [torch.multinomial(q[i], draws, replacement=True, generator=gen).tolist() for i in range(gamma)]
        windows = [[cols[i][n] for i in range(gamma)] for n in range(draws)]
    else:
        assert fixed_drafts is not None
        windows = [fixed_drafts] * draws
    counts = torch.zeros(vocab)
    for drafts in windows:
        counts[verify_window(target_logits, drafts, q, params, gen).tokens[0]] += 1
    return counts


def _masked(logits: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.full_like(logits, NEG)
    out[..., keep] = logits[..., keep]
    return out


CASES = {
    "random p and q": dict(tl=(0, [], None), dl=(1, [], None), params=SamplingParams(temperature=1.0)),
    "disjoint supports": dict(
        tl=(2, [0, 1, 2], None), dl=(3, [5, 6, 7], None), params=SamplingParams(temperature=1.0)
    ),
    "q zero where p > 0": dict(tl=(4, [], None), dl=(5, [0, 1], None), params=SamplingParams(temperature=0.8)),
    "top-k and top-p warps": dict(
        tl=(6, [], None), dl=(7, [], None), params=SamplingParams(temperature=1.2, top_k=5, top_p=0.8)
    ),
    "top-p only, hot": dict(tl=(8, [], None), dl=(9, [], None), params=SamplingParams(temperature=2.0, top_p=0.6)),
    "deterministic drafter": dict(tl=(10, [], None), dl=None, params=SamplingParams(temperature=1.0)),
}


def _logits(spec: tuple[int, list[int], None], rows: int, vocab: int = 8) -> torch.Tensor:
    seed, keep, _ = spec
    g = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(rows, vocab, generator=g) * 1.5
    return _masked(logits, keep) if keep else logits


@pytest.mark.parametrize("name", list(CASES))
def test_first_emitted_token_follows_target_distribution(name: str) -> None:
    case = CASES[name]
    params: SamplingParams = case["params"]
    gamma = 2
    target_logits = _logits(case["tl"], gamma + 1)
    if case["dl"] is None:
        q = None
        fixed = [3, 3]
    else:
        q = warp(_logits(case["dl"], gamma), params)
        fixed = None
    counts = _first_token_counts(target_logits, q, params, draws=6_000, seed=11, fixed_drafts=fixed)
    p0 = warp(target_logits[0], params)
    pval = chi2_pvalue(counts, p0)
    assert pval > 1e-3, f"{name}: emitted {counts.tolist()} vs target {p0.tolist()} (p-value {pval:.2e})"


def test_chi_square_detects_a_wrong_verifier() -> None:
    """The test above can fail: emitting the draft's distribution instead is rejected."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.softmax(torch.randn(8, generator=gen), -1)
    q0 = torch.softmax(torch.randn(8, generator=gen), -1)
    counts = torch.bincount(torch.multinomial(q0, 10_000, replacement=True, generator=gen), minlength=8)
    assert chi2_pvalue(counts, p0) < 1e-6


def test_two_token_joint_distribution_through_generation_loop() -> None:
    """Run windows until two tokens are out: their joint law is p0 ⊗ p1 (context-free target)."""
    vocab, gamma, runs = 4, 3, 5_000
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(5)
    p_logits = torch.randn(6, vocab, generator=g)
    q = warp(torch.randn(6, vocab, generator=g), params)
    q[:, 0] = 0.0  # the draft never proposes token 0, which the target does emit
    q = q / q.sum(-1, keepdim=True)
    # Draft token for (run, position); a window starting at `pos` only uses untested positions.
    pre = torch.stack([torch.multinomial(q[t], runs, replacement=True, generator=g) for t in range(6)], 1)
    counts = torch.zeros(vocab * vocab)
    for r in range(runs):
        row = pre[r].tolist()
        out: list[int] = []
        while len(out) < 2:
            pos = len(out)
            verdict = verify_window(
                p_logits[pos : pos + gamma + 1], row[pos : pos + gamma], q[pos : pos + gamma], params, g
            )
            out.extend(verdict.tokens)
        counts[out[0] * vocab + out[1]] += 1
    p = warp(p_logits, params)
    joint = torch.outer(p[0], p[1]).flatten()
    assert chi2_pvalue(counts, joint) > 1e-3


def test_acceptance_rate_matches_theory() -> None:
    """P(accept first draft) = Σ min(p, q): the verifier is not merely unbiased but optimal."""
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(9)
    tl = torch.randn(2, 6, generator=g)
    q = warp(torch.randn(1, 6, generator=g), params)
    p = warp(tl, params)
    draws = 5_000
    xs = torch.multinomial(q[0], draws, replacement=True, generator=g).tolist()
    accepted = sum(verify_window(tl, [x], q, params, g).accepted for x in xs)
    expected = float(torch.minimum(p[0], q[0]).sum())
    sd = (expected * (1 - expected) / draws) ** 0.5
    assert abs(accepted / draws - expected) < 4 * sd


def test_sampling_is_reproducible_with_a_seed() -> None:
    params = SamplingParams(temperature=1.0)
    tl = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    q = warp(torch.randn(3, 8, generator=torch.Generator().manual_seed(2)), params)
    a = [verify_window(tl, [1, 2, 3], q, params, torch.Generator().manual_seed(s)) for s in range(20)]
    b = [verify_window(tl, [1, 2, 3], q, params, torch.Generator().manual_seed(s)) for s in range(20)]
    assert a == b


# --- stops -----------------------------------------------------------------------------------

PIECES = {0: "a", 1: "b", 2: "<e", 3: "nd>", 4: " ", 5: "\n\n", 6: "x", 7: "<end", 8: ">", 9: "</s>"}


def toy_decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


class ToyTokenizer:
    def decode(self, ids: list[int]) -> str:
        return toy_decode(ids)


def test_eos_ends_generation_and_is_kept() -> None:
    m = find_stop([0, 1, 9, 0], {9})
    assert m is not None and (m.length, m.reason) == (3, "eos")
    assert find_stop([0, 1, 0], {9}) is None


def test_stop_string_split_across_tokens_and_windows() -> None:
    # Window 1 ends with "<e"; window 2 completes "<end>" with its first token.
    assert find_stop([0, 2], {9}, stop_strings=["<end>"], tokenizer=ToyTokenizer()) is None
    m = find_stop([0, 2, 3, 1, 6], {9}, stop_strings=["<end>"], tokenizer=ToyTokenizer(), start=2)
    assert m is not None and (m.length, m.reason, m.stop_string) == (3, "stop", "<end>")
    m = find_stop([0, 7, 8, 9], {9}, stop_strings=["<end>", "\n\n"], tokenizer=toy_decode)
    assert m is not None and m.length == 3 and m.stop_string == "<end>"


def test_find_stop_equals_one_token_at_a_time_decoding() -> None:
    rng = random.Random(4)
    stops = ["<end>", "b b", "\n\n"]
    for _ in range(300):
        tokens = [rng.randrange(10) for _ in range(rng.randint(1, 15))]
        expected = None
        for i in range(len(tokens)):
            if tokens[i] == 9 or any(s in toy_decode(tokens[: i + 1]) for s in stops):
                expected = i + 1
                break
        # Check in random windows, as the head does.
        start, found = 0, None
        while start < len(tokens) and found is None:
            end = min(len(tokens), start + rng.randint(1, 5))
            found = find_stop(tokens[:end], {9}, stop_strings=stops, tokenizer=ToyTokenizer(), start=start)
            start = end
        assert (found.length if found else None) == expected, tokens


def test_find_stop_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        find_stop([1], set(), stop_strings=["x"])
    with pytest.raises(ValueError, match="non-empty"):
        find_stop([1], set(), stop_strings=[""], tokenizer=ToyTokenizer())
    with pytest.raises(ValueError, match="start"):
        find_stop([1], set(), start=3)


def test_stream_safe_length_holds_back_possible_stop_prefixes() -> None:
    assert stream_safe_length("hello <en", ["<end>"]) == len("hello ")
    assert stream_safe_length("hello", ["<end>"]) == 5
    assert stream_safe_length("ab<end>cd", ["<end>"]) == 2
    assert stream_safe_length("a\n", ["\n\n", "<end>"]) == 1
    assert stream_safe_length("", ["<end>"]) == 0


def test_cut_at_stop_keeps_the_text_before_the_earliest_stop() -> None:
    stops = ("\ndef ", "\nif __name__")
    text = "    return False\n\n\nif __name__ == '__main__':\n\ndef g"
    assert cut_at_stop(text, stops) == ("    return False\n\n", True)
    assert cut_at_stop("    return 1", stops) == ("    return 1", False)
    assert cut_at_stop("x<end>", ("<end>", "x")) == ("", True)
