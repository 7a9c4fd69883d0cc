"""The bf16-noise rule (pipeline/tools/fidelity.py) on the default model: healthy bf16 captures pass it on real
text and on random tokens (where single tokens stray far from float32), and it fails each kind of damage
the tests and the audit must catch: another sample's states, the neighbouring layer, the sequence offset by
one token, one corrupted value."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.tools.audit import Reference
from pipeline.tools.fidelity import (
    DEFAULT_RULE,
    FINAL_DEPTH,
    FLOOR,
    NoiseRule,
    as_float,
    ratios,
    token_errors,
    upstream_noise,
)
from tests_support import stored_blocks

LAYERS = (2, 14, 15, 16, 27)  # 14-16: neighbours for the shifted-layer case
DEPTHS = [*LAYERS, FINAL_DEPTH]


@pytest.fixture(scope="module")
def case(model_dir, text_ids):
    """{key: (ids, captured blocks, truth blocks, yardstick blocks)}: captures from the hf engine (batched
    together, so not the yardstick's forwards), truth and yardstick from the audit's reference."""
    from actors.hf.engine import HFEngine

    rng = np.random.default_rng(5)
    prompts = {f"text{i}": ids for i, ids in enumerate(text_ids)}
    prompts |= {f"rand{i}": rng.integers(100, 49000, n).tolist() for i, n in enumerate((24, 60, 60, 130))}
    with HFEngine(str(model_dir), LAYERS, max_batch_tokens=4096, cpu_threads=2) as eng:
        caps = eng.capture(list(prompts.items()))
    with Reference(model_dir, LAYERS) as ref:
        refs = ref.layers(list(prompts.values()))
    out = {}
    for (key, ids), (truth, yard) in zip(prompts.items(), refs):
        aux, last = caps[key].capture.bits()
        ups = upstream_noise(truth, yard, DEPTHS)
        out[key] = (ids, [as_float(b) for b in stored_blocks(aux, last, len(LAYERS))], truth, yard, ups)
    return out


def test_healthy_captures_pass_with_margin(case):
    worst_sample = worst_token = worst_peak = 0.0
    for key, (_, got, truth, yard, ups) in case.items():
        for j, (g, t, y, u) in enumerate(zip(got, truth, yard, ups)):
            d = DEFAULT_RULE.judge(g, t, y, u)
            assert d.passed, (key, j, d.why())
            s, tok, peak = ratios(g, t, y, u)
            worst_sample, worst_token, worst_peak = max(worst_sample, s), max(worst_token, tok), max(worst_peak, peak)
    # The margin the factors are chosen for (fidelity.py): healthy data well inside every one.
    assert worst_sample * 2 <= DEFAULT_RULE.sample_factor and worst_token * 2 <= DEFAULT_RULE.token_factor
    assert worst_peak * 2 <= DEFAULT_RULE.token_factor
    print(
        f"\nhealthy: worst sample {worst_sample:.2f}x its yardstick, worst token {worst_token:.2f}x its base, "
        f"worst largest element {worst_peak:.2f}x its base"
    )


def _fails(got, truth, yard, upstream) -> float:
    """Fails, with the sample's own upstream noise widening its tokens' allowances as in the audit."""
    d = DEFAULT_RULE.judge(got, truth, yard, upstream)
    assert not d.passed, d
    return max(ratios(got, truth, yard, upstream))


def test_another_samples_states_fail(case):
    keys = sorted(case, key=lambda k: len(case[k][0]))
    seen = []
    for a, b in zip(keys, keys[1:]):  # b is at least as long: its first len(a) rows stand in for a's
        n = len(case[a][0])
        _, _, truth, yard, ups = case[a]
        for j in range(len(LAYERS) + 1):
            seen.append(_fails(case[b][1][j][:n], truth[j], yard[j], ups[j]))
    print(f"\nswapped sample: at least {min(seen):.1f}x")


def test_the_neighbouring_layer_fails(case):
    seen = []
    for _, got, truth, yard, ups in case.values():
        k14, k15, k16 = LAYERS.index(14), LAYERS.index(15), LAYERS.index(16)
        seen.append(_fails(got[k16], truth[k15], yard[k15], ups[k15]))  # layer 16 stored as 15
        seen.append(_fails(got[k14], truth[k15], yard[k15], ups[k15]))  # layer 14 stored as 15
    print(f"\nneighbouring layer: at least {min(seen):.1f}x")


def test_a_sequence_offset_by_one_token_fails(case):
    seen = []
    for _, got, truth, yard, ups in case.values():
        for j in range(len(LAYERS) + 1):
            shifted = np.concatenate([got[j][1:], got[j][-1:]])  # every row one position late
            seen.append(_fails(shifted, truth[j], yard[j], ups[j]))
    print(f"\noffset by one token: at least {min(seen):.1f}x")


def test_one_corrupted_value_fails(case):
    """The largest value of one token with its sign flipped (one bit), in every layer of every sample."""
    seen = []
    for _, got, truth, yard, ups in case.values():
        for j in range(len(LAYERS) + 1):
            bad = got[j].copy()
            t = len(bad) // 2
            c = int(np.argmax(np.abs(bad[t])))
            bad[t, c] = -bad[t, c]
            seen.append(_fails(bad, truth[j], yard[j], ups[j]))
    print(f"\none corrupted value: at least {min(seen):.1f}x")


def test_the_rule_on_hand_made_arrays():
    rng = np.random.default_rng(0)
    truth = rng.standard_normal((6, 8))
    yard = truth * (1 + 0.01 * rng.standard_normal(truth.shape))
    assert DEFAULT_RULE.judge(truth, truth, yard).passed  # exact: passes
    assert DEFAULT_RULE.judge(yard, truth, yard).passed  # the yardstick itself: passes
    assert not DEFAULT_RULE.judge(2 * truth, truth, yard).passed  # scale is seen (cosine is blind to it)
    assert not DEFAULT_RULE.judge(truth[:5], truth, yard).passed  # truncated
    nan = truth.copy()
    nan[2, 3] = np.nan
    assert np.isinf(token_errors(nan, truth)[2]) and not DEFAULT_RULE.judge(nan, truth, yard).passed
    # A float32 capture stored as bf16 passes even against an exact yardstick: the floor is bf16's roundoff.
    rounded = as_float((truth.astype(np.float32).view(np.uint32) + 0x8000 >> 16).astype(np.uint16))
    assert DEFAULT_RULE.judge(rounded, truth, truth).passed and token_errors(rounded, truth).max() < FLOOR
    assert DEFAULT_RULE.judge(np.zeros((0, 8)), np.zeros((0, 8)), np.zeros((0, 8))).passed
    strict = NoiseRule(sample_factor=0.5, token_factor=0.5, floor=0.0)
    assert not strict.judge(yard, truth, yard).passed  # the factors are what decide


def test_a_tokens_drift_in_shallower_layers_widens_its_allowance_deeper_and_only_deeper():
    """The healthy case the per-layer rule failed: a token both yardsticks stray on at a shallow layer, back
    near float32 at the final one, where the capture stays off. Drift flows up the residual stream, never down."""
    rng = np.random.default_rng(1)
    truth = [rng.standard_normal((6, 64)) for _ in range(3)]  # layers 3 and 9, then the final state

    def off(x, token, by):  # x with one token moved ~`by` (relative L2), the others ~0.02 as bf16 forwards are
        y = x + 0.02 * np.linalg.norm(x, axis=1, keepdims=True) * rng.standard_normal(x.shape) / 8
        y[token] = x[token] + by * np.linalg.norm(x[token]) * rng.standard_normal(64) / 8
        return y

    yard = [(off(truth[0], 2, 0.1), off(truth[0], 2, 0.1)), (off(truth[1], 2, 0.1),), (off(truth[2], 2, 0.02),)]
    got = [off(truth[0], 2, 0.2), off(truth[1], 2, 0.2), off(truth[2], 2, 0.25)]
    depths = [3, 9, FINAL_DEPTH]
    alone = DEFAULT_RULE.judge(got[2], truth[2], yard[2])
    assert not alone.passed and alone.worst_token == 2  # judged by its own layer's yardsticks only: fails
    assert all(d.passed for d in DEFAULT_RULE.judge_layers(got, truth, yard, depths))
    # Given in another order, the depths still decide what is shallower.
    order = [2, 0, 1]
    shuffled = ([x[i] for i in order] for x in (got, truth, yard))
    assert all(d.passed for d in DEFAULT_RULE.judge_layers(*shuffled, [depths[i] for i in order]))
    # A shallow layer gets nothing from a deeper one's drift: layer 3 off at token 4, only the final's yardsticks there.
    yard2 = [(off(truth[0], 4, 0.02),), (off(truth[1], 4, 0.02),), (off(truth[2], 4, 0.3),)]
    got2 = [off(truth[0], 4, 0.3), off(truth[1], 4, 0.02), off(truth[2], 4, 0.02)]
    first = DEFAULT_RULE.judge_layers(got2, truth, yard2, depths)[0]
    assert not first.passed and first.worst_token == 4
    # Damage stays visible: another token of the final state far off, where no layer strays.
    bad = off(truth[2], 5, 0.5)
    assert not DEFAULT_RULE.judge_layers([got[0], got[1], bad], truth, yard, depths)[2].passed
    with pytest.raises(ValueError, match="tokens"):
        DEFAULT_RULE.judge(truth[2], truth[2], yard[2], np.zeros(5))


def test_routing_near_ties_allow_what_a_flip_moves_and_no_more_from_their_layer_up():
    """A token whose top-2 choice among 4 experts is a near tie (margin within ROUTE_FACTOR x the yardsticks'
    router error) at MoE layer 3 is allowed FLIP_FACTOR x what a flip there moves it at layers >= 3 only."""
    from pipeline.tools.fidelity import FLIP_FACTOR, ROUTE_FACTOR, near_tie_routes, near_tie_tokens

    scores = np.array([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.995, 0.0], [1.0, 1.0, 1.0, 1.0]])
    yard = scores + 0.002
    yard[:, 1] -= 0.004  # the yardstick strays 0.004 at most on every token
    ties = near_tie_routes(scores, [yard], top_k=2)
    assert ties.tolist() == [False, True, True]  # margins 1.0, 0.005, 0.0 against 4 x 0.004
    assert not near_tie_routes(scores, [yard], top_k=2, factor=1.0)[1]  # 0.005 > 1 x 0.004
    assert not near_tie_routes(scores, [yard], top_k=4).any()  # every expert chosen: nothing to flip
    move, peak = np.array([5.0, 0.4, 0.3]), np.array([1.0, 0.1, 0.05])
    by_layer = {3: (ties, move, peak), 6: (np.zeros(3, bool), move, peak)}
    assert near_tie_tokens(by_layer, 2) is None  # below the MoE layer
    at3 = near_tie_tokens(by_layer, 3)
    assert at3.tokens.tolist() == [False, True, True] and at3.move.tolist() == [0.0, 0.4, 0.3]
    both = near_tie_tokens({3: (ties, move, peak), 5: (ties, move, peak)}, FINAL_DEPTH)
    # Flips at two layers add as independent changes: root of the sum of squares.
    assert np.allclose(both.move, [0.0, 0.4 * 2**0.5, 0.3 * 2**0.5]) and np.allclose(
        both.peak, [0, 0.1 * 2**0.5, 0.05 * 2**0.5]
    )
    assert near_tie_tokens({6: (np.zeros(3, bool), move, peak)}, FINAL_DEPTH) is None
    assert near_tie_tokens(by_layer, 3).take([1]).tokens.tolist() == [True]

    # The judge: token 1 moved by a dense change of 20x the noise; at a near tie whose flip moves it that far it
    # passes, with a smaller flip it fails; a flipped sign of its largest element fails however dense the flip.
    from pipeline.tools.fidelity import NearTies

    rng = np.random.default_rng(2)
    truth = rng.standard_normal((40, 32))
    yards = truth * (1 + 0.002 * rng.standard_normal(truth.shape))
    got = yards.copy()
    jump = 0.002 * 20 * np.linalg.norm(truth[1]) * rng.standard_normal(32) / np.sqrt(32)
    got[1] = truth[1] + jump
    only_1 = np.arange(40) == 1

    def tie(size):  # token 1 at a near tie whose flip moves it by `size` x the jump
        move = np.where(only_1, size * np.linalg.norm(jump), 0.0)
        return NearTies(only_1, move, np.where(only_1, size * np.abs(jump).max(), 0.0))

    assert not DEFAULT_RULE.judge(got, truth, yards).passed
    ok = DEFAULT_RULE.judge(got, truth, yards, near_ties=tie(1.0))
    assert ok.passed and ok.near_ties == 1
    assert not DEFAULT_RULE.judge(got, truth, yards, near_ties=tie(0.2)).passed
    other = NearTies(~only_1, np.where(~only_1, 10.0, 0.0), np.where(~only_1, 10.0, 0.0))
    assert not DEFAULT_RULE.judge(got, truth, yards, near_ties=other).passed  # other tokens' ties: no help
    flipped = yards.copy()
    c = int(np.argmax(np.abs(flipped[1])))
    flipped[1, c] = -flipped[1, c]
    assert DEFAULT_RULE.judge(yards, truth, yards, near_ties=tie(1.0)).passed
    assert not DEFAULT_RULE.judge(flipped, truth, yards, near_ties=tie(1.0)).passed
    assert ROUTE_FACTOR > 2 and FLIP_FACTOR >= 1  # one bf16 forward moves a margin by up to twice its stray
