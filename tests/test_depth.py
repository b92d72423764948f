"""The depth policy alone: pure arithmetic on measured costs and acceptance."""

import random
import time

import pytest

import tiny
from starsd.config import DraftConfig, SamplingConfig
from starsd.models.drafter import Drafter
from starsd.models.pair import Pair
from starsd.prompts import Prompt
from starsd.spec_decode.decode import measure_verify, speculative, target_only
from starsd.spec_decode.depth import MAX_STOP, MISS_STEPS, Decision, DepthPolicy, Source, decide
from starsd.spec_decode.estimates import Acceptance, Costs


def test_draft_costs_are_a_line_through_each_depths_median():
    line = Costs(5.0, extend="line")
    assert line(3) == 15.0  # the prior per level, with no points
    line.add(4, 40.0)
    assert line(2) == pytest.approx(20.0)  # one depth seen: proportional
    line.add(8, 60.0)
    assert line(6) == pytest.approx(50.0) and line(0) == pytest.approx(20.0) and line(10) == pytest.approx(70.0)
    flat = Costs(5.0, extend="line", proportional=False)
    flat.add(3, 30.0)
    assert flat(1) == 30.0


def test_verify_costs_interpolate_between_widths_and_take_each_widths_median():
    table = Costs(100.0)
    assert table(7) == 100.0
    table.add(1, 600.0)
    table.add(11, 2500.0)
    assert table(1) == 600.0 and table(6) == pytest.approx(1550.0) and table(20) == 2500.0
    table.add(1, 700.0)
    table.add(1, 9000.0)  # a pass slowed by something else: the median does not move far
    assert table(1) == pytest.approx(700.0)


def test_a_cost_not_measured_for_a_window_no_longer_counts():
    table = Costs(100.0, window=4)
    table.add(3, 5000.0)  # a first pass's warm-up, at a width not used again
    for _ in range(4):
        table.add(1, 500.0)
    assert table(3) == 500.0  # beyond the measured widths now: its neighbour's cost, until tried again


def test_acceptance_by_position():
    acc = Acceptance(4, decay=1.0, strength=0.0)
    for _ in range(10):
        acc.add(4, 4)
    assert acc.expected(4) == pytest.approx(4.0)
    acc = Acceptance(4, decay=1.0, strength=0.0)
    for accepted in (0, 1, 2, 2):  # P(first 1) = 3/4, P(first 2) = 1/2, P(first 3) = 0
        acc.add(4, accepted)
    assert acc.expected(1) == pytest.approx(0.75)
    assert acc.expected(2) == pytest.approx(1.25)
    assert acc.expected(3) == pytest.approx(1.25)


def test_one_rejected_draft_does_not_end_drafting():
    """The prior: a first draft whose first token is rejected leaves the first position's rate near
    a third, not at 0, so drafting stays worth a try where it is cheap."""
    acc = Acceptance(8)
    acc.add(8, 0)
    rates = acc.rates()
    assert 0.2 < rates[0] < 0.6
    assert rates[5] == pytest.approx((0 + 2 * 0.8) / (1 + 2))  # untested: all positions' rate, with the prior


def test_positions_little_tested_are_drawn_widely():
    acc = Acceptance(4)
    for _ in range(60):
        acc.add(2, 2)  # the first two always right, positions 3 and 4 never tested
    rng = random.Random(1)
    draws = [acc.rates(rng) for _ in range(400)]
    first = [r[0] for r in draws]
    third = [r[2] for r in draws]
    assert min(first) > 0.85  # well known
    assert max(third) - min(third) > 0.3  # barely known: wide


def measured_table(figures: dict[int, float], times: int = 3) -> Costs:
    """Verify costs by width, each measured `times` times (3: they count for good)."""
    costs = Costs(0.0)
    for w, ms in figures.items():
        for _ in range(times):
            costs.add(w, ms)
    return costs


def decided(policy: DepthPolicy, limit: int, before_prefill: bool = False, **source) -> Decision:
    """The decision on the policy's figures alone (no look due, no pause): the pure rule."""
    return decide(policy.situation(limit, Source(**source), before_prefill=before_prefill))


def run(policy: DepthPolicy, steps: int, decode_ms: float, verify_per_token: float, draft_per_level: float,
        wait_ms: float, right: int = 8, verify=None, share_per_level: float | None = None,
        source: Source = Source()) -> list[int]:
    """Feed the policy a synthetic stream whose drafts are right for their first `right` tokens (and
    wrong at the next);
    a verify pass of w tokens costs verify(w), by default decode_ms + verify_per_token * (w - 1);
    `share_per_level`: a co-hosted server's compute on a draft, per level; `source`: the drafter's."""
    verify = verify or (lambda w: decode_ms + verify_per_token * (w - 1))
    chosen = []
    for _ in range(steps):
        d = policy.choose(8, source).depth
        chosen.append(d)
        accepted = min(d, right)
        share = (d, share_per_level * d) if d and share_per_level is not None else None
        policy.observe(d, accepted, wait_ms + draft_per_level * d if d else None, d + 1, verify(d + 1), share)
    return chosen


def learnt(right: int) -> DepthPolicy:
    """A policy that has drafted for a while from a fast server (drafts right for their first
    `right` tokens) and then met a slow one (a 2 s wait), and decodes alone since."""
    policy = DepthPolicy(8, explore=16)
    run(policy, 64, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2, right=right)
    run(policy, 64, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2000, right=right)
    return policy


def test_drafts_deep_when_drafting_pays():
    chosen = run(DepthPolicy(8, explore=16), 64, decode_ms=100, verify_per_token=1, draft_per_level=5, wait_ms=2)
    assert sum(d == 8 for d in chosen[-32:]) >= 28  # deep, but for the odd look beside


def test_a_first_step_slowed_by_warm_up_and_rejected_does_not_stop_drafting():
    """Seen on this machine's pair co-located: the stream's first step verified 3 tokens in 2.7 s (a
    first call's warm-up; 0.5 s later) and its draft was rejected at once. Trusting both, the policy
    decoded alone for 15 steps, then drafted one token a step for the rest of the answer (0.6x the
    best fixed depth). The drafts are right for 6 tokens a step; verifying costs 500 ms up to 3
    tokens, 150 ms a token beyond; drafting 60 ms a level."""
    policy = DepthPolicy(10, explore=16)
    policy.observe(2, 0, None, 3, 2700.0)
    verify = lambda w: 500.0 + 150.0 * max(0, w - 3)
    chosen = run(policy, 64, 500, 0, draft_per_level=60, wait_ms=0, right=6, verify=verify)
    # tokens per ms: 1/500 alone, 3/620 at depth 2, 7/1310 at depth 6, 6/1330 at depth 8 (the draft is wrong there)
    tail = chosen[-32:]
    assert sum(4 <= d <= 8 for d in tail) >= 26 and chosen[1:16].count(0) <= 2


def confident(policy: DepthPolicy, steps: int, told: bool = True, source: Source = Source()) -> list[int]:
    """A stream whose drafts stop by their own confidence (min_path_prob): 30% are sure, run 8
    levels when let and are accepted whole; the rest stop at 2 levels and the second is rejected.
    Verifying costs 300 ms and 5 a token more, drafting 47 ms a level (the 1.5B target and 0.5B draft
    on transformers here). `told`: the policy hears the depth each draft was asked for."""
    rng = random.Random(3)
    chosen = []
    for _ in range(steps):
        d = policy.choose(10, source).depth
        chosen.append(d)
        if d:
            sure = rng.random() < 0.3
            levels = min(d, 8 if sure else 2)
            policy.observe(levels, levels if sure else 1, 47.0 * levels, levels + 1, 300.0 + 5 * levels,
                           asked=d if told else None)
        else:
            policy.observe(0, 0, None, 1, 300.0)
    return chosen


def test_a_draft_that_stops_short_by_its_own_confidence_is_asked_deep():
    """Asked 10 deep, such drafts cost 3.8 levels on average and yield 4.1 tokens a step: 8.2 tokens/s,
    against 5.7 asked 2 or 3 deep. Weighed as if every ask drafted all its levels, and with what an
    accepted draft does next taken from all drafts, the deep asks looked dear and poor: the stream
    spread its asks over every depth (1 the most)."""
    tail = confident(DepthPolicy(10, explore=16), 200)[-64:]
    assert sum(d >= 8 for d in tail) >= 56
    assert sum(d >= 8 for d in confident(DepthPolicy(10, explore=16), 200, told=False)[-64:]) < 40


def test_a_stream_whose_chains_stop_themselves_asks_as_deep_as_the_step_allows():
    """With auto_stop each chain stops where one more level no longer pays, by the draft's own
    confidence at that step: a better guide to how deep than what each position's acceptance has
    been. Replayed over recorded drafts (bench depth-replay, a transformers target, 8 chat answers),
    asks capped at a depth drawn from the positions' acceptance made 0.90x the best fixed depth
    with a fresh policy per answer and 0.96x carried over the answers; asks as deep as the step
    allows 0.96x and 0.99x. Whether to draft at all stays the policy's: a slow server is not asked."""
    chosen = confident(DepthPolicy(10, explore=16), 64, source=Source(stops=True))
    assert set(chosen) <= {0, 10} and chosen.count(10) >= 56
    slow = run(DepthPolicy(8, explore=16), 160, decode_ms=100, verify_per_token=1, draft_per_level=5,
               wait_ms=2000, source=Source(stops=True))
    assert slow[0] == 8 and sum(d == 0 for d in slow[-128:]) >= 124


def test_decodes_alone_when_the_draft_server_is_slow():
    """A draft that costs more than it wins back: the stream stops asking, but looks again now and then."""
    chosen = run(DepthPolicy(8, explore=16), 160, decode_ms=100, verify_per_token=1, draft_per_level=5, wait_ms=2000)
    tail = chosen[-128:]
    looks = [i for i, d in enumerate(chosen) if d > 0 and i >= 16]
    assert sum(d == 0 for d in tail) >= 124 and looks  # it looks again, ever more rarely
    assert all(b - a >= a - prev for prev, a, b in zip(looks, looks[1:], looks[2:]))


def test_a_stream_drafts_again_at_its_first_look_once_its_server_is_fast_again():
    """Seen on a ramp of replay targets (bench elastic): 32 targets saturated one draft server, then 30
    left. The two that stayed decoded alone for the rest of the run (1.0x, where 1.5x was theirs
    before): each look drafted fast, but one fast draft every 64, 128, 256 steps hardly moved a
    median of nine slow ones. A look whose draft comes in under half the figures' time voids them."""
    policy = learnt(right=6)  # drafted from a fast server, then met a 2 s wait, and decodes alone since
    chosen = run(policy, 400, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2, right=6)
    looked = next(i for i, d in enumerate(chosen) if d)
    assert looked < 100 and sum(map(bool, chosen[looked:looked + 64])) >= 56
    slow = learnt(right=6)  # a look that finds the server as slow as before changes nothing: only the looks draft
    assert sum(map(bool, run(slow, 400, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2000,
                             right=6))) <= 4


def test_shallow_when_verifying_is_expensive():
    """A CPU whose verify cost grows with the tokens scored and a draft right for two tokens: the
    best depth is 2 (tokens per ms: 1/100 alone, 2/142 at 1, 3/182 at 2, 3/222 at 3)."""
    chosen = run(DepthPolicy(8, explore=16), 96, decode_ms=100, verify_per_token=30, draft_per_level=10, wait_ms=2,
                 right=2)
    assert sum(d == 2 for d in chosen[-32:]) >= 28


def test_decodes_alone_on_a_cpu_whose_verify_cost_jumps_after_one_token():
    """This machine's 1.5B target in fp32 (verify ms by tokens scored, measured) and a draft right
    for two tokens: no depth beats decoding alone (1/619 tokens per ms against at best 3/1894 at
    depth 2). A cost line through the widths a deep draft uses would put one token near 2.4 s and
    never let the stream decode alone. A width measured once is tried again after a while (a pass
    slowed once must not rule it out for good): 16 steps of 192 at the most."""
    table = measured_table({1: 619, 2: 1214, 3: 1812, 4: 1962, 6: 2128, 8: 2101, 11: 2499, 16: 2370}, times=1)
    chosen = run(DepthPolicy(8, explore=16), 256, 0, 0, draft_per_level=41, wait_ms=2, right=2, verify=table)
    assert sum(d == 0 for d in chosen[-192:]) >= 176 and any(d > 0 for d in chosen[-192:])


def test_one_token_passes_slowed_long_ago_do_not_keep_a_stream_drafting():
    """A stream's one-token passes were slowed by a draft computed beside them (a server on the same
    cores): 150 ms each, against 31 ms alone. Weighed against them, a draft at 40 ms a level pays, and
    a stream that always drafts never measures a one-token pass again: it drafted at about half the
    speed of decoding alone. Once that figure is old, a look decodes alone, its pass replaces the old
    ones, and the stream decodes alone from then on."""
    table = measured_table({1: 31, 2: 40, 4: 50, 8: 70, 12: 90}, times=1)  # wide passes cost little more than one
    policy = DepthPolicy(8, explore=16)
    for _ in range(9):
        policy.verify_ms.add(1, 150.0)
    # tokens per ms by the drafts' real figures: 1/31 alone, 2/70 at depth 1, 3/105 at 2, 4/137 at 3
    chosen = run(policy, 192, 0, 0, draft_per_level=30, wait_ms=0, right=3, verify=table)
    assert chosen[:32].count(0) <= 2  # drafting, by the slowed figure
    assert chosen[-64:].count(0) >= 56


def test_a_streams_second_step_measures_decoding_alone():
    """A stream starts at full depth, and its first pass, 11 tokens on llama.cpp's CPU table (178 ms
    against 31 for one), would stand for a one-token pass too: a draft at 60 ms a level would then
    look worth it for 16 steps. The second step decodes alone instead, and from then on the stream
    knows that no draft pays."""
    table = measured_table({1: 31, 2: 50, 4: 85, 8: 148, 12: 178, 16: 178}, times=1)
    chosen = run(DepthPolicy(8, explore=16), 16, 0, 0, draft_per_level=60, wait_ms=2, right=3, verify=table)
    assert chosen[:2] == [8, 0] and chosen[2:].count(0) >= 12


def test_a_new_stream_opens_as_deep_as_its_servers_cost_per_level_allows():
    """Nothing measured yet: a draft is taken as nearly free, and the stream opens at full depth. A
    server whose Welcome says a level has cost 60 ms of late (against the 100 ms a pass is taken to
    cost until measured) opens it at one or two levels; and a co-hosted one's asks ahead are judged
    at that compute until the stream measures its own."""
    assert DepthPolicy(8).choose(8).depth == 8
    told = DepthPolicy(8)
    told.server_prior(60.0)
    assert 1 <= told.choose(8).depth <= 2
    assert told.draft_ms(4) == pytest.approx(240.0) and told.share_ms(4) == pytest.approx(240.0)
    told.observe(1, 1, 30.0, 2, 100.0)
    told.server_prior(90.0)  # a later Welcome (a new session) changes no figure the stream has
    assert told.draft_ms(1) == pytest.approx(30.0) and told.share_ms(4) == pytest.approx(360.0)


def test_one_policy_carries_over_a_streams_generations(tiny_target, tiny_drafters):
    """A target keeps one policy for all its prompts: the second starts from what the first learnt."""
    cfg = DraftConfig(depth=4)
    policy = DepthPolicy(4, verify_ms=slow_target())
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    gens = [speculative(tiny_target, tiny_drafters["good"], p, 24, cfg, SamplingConfig(), policy=policy)
            for p in prompts]
    for p, g in zip(prompts, gens):
        assert g.token_ids == target_only(tiny_target, p, 24, SamplingConfig()).token_ids
    assert policy.steps == sum(g.num_steps for g in gens)
    assert sum(policy.acceptance.tests) > 0 and policy.verify_ms.samples


def test_a_pair_keeps_one_policy_for_all_its_generations(tiny_target, tiny_drafters):
    """Co-located as in a target process: a Pair's second generation starts from what its first
    learnt (one policy per drafter and draft shape; none at a fixed depth)."""
    pair = Pair(tiny_target, tiny_drafters["good"], tiny.char_tokenizer(), frozenset())
    cfg = DraftConfig(depth=4)
    policy = pair.policy(pair.drafter, cfg)
    assert policy is pair.policy(pair.drafter, cfg) and policy.max_depth == 4
    assert policy is not pair.policy(tiny_drafters["random"], cfg) and policy is not pair.policy(pair.drafter,
                                                                                                DraftConfig(depth=6))
    assert pair.policy(pair.drafter, DraftConfig(depth=4, adaptive=False)) is None
    gens = [pair.generate(Prompt(str(i), text, chat=False), 16, SamplingConfig(), cfg) for i, text in enumerate(["def f(x):", "ab"])]
    assert policy.steps == sum(g.num_steps for g in gens)


def test_a_pairs_first_policy_warms_its_target_first(tiny_target, tiny_drafters, monkeypatch):
    """An engine's first pass after loading is far its slowest (transformers in bf16 on an AMX Xeon:
    813 ms for 2 tokens, then 220-230), and a fresh stream that measured it once decoded alone for 14
    steps: a Pair's first adaptive generation starts after one untimed pass on a throwaway stream,
    and later generations do not pay it again."""
    pair = Pair(tiny_target, tiny_drafters["good"], tiny.char_tokenizer(), frozenset())
    started = []
    real = tiny_target.start
    monkeypatch.setattr(tiny_target, "start", lambda ids, *a, **kw: started.append(list(ids)) or real(ids, *a, **kw))
    prompts = [Prompt(str(i), text, chat=False) for i, text in enumerate(["def f(x):", "ab"])]
    for prompt in prompts:
        pair.generate(prompt, 8, SamplingConfig(), DraftConfig(depth=4))
    assert started[1:] == [p.encode(pair.tokenizer) for p in prompts]
    assert len(started[0]) == 16  # the throwaway stream, before the first prompt
    pair.generate(prompts[0], 8, SamplingConfig(), DraftConfig(depth=4, adaptive=False))
    assert len(started) == 4  # a fixed depth measures nothing: no warm-up either


def test_a_stream_drafting_in_this_process_measures_a_one_token_pass_first(tiny_target, tiny_drafters):
    """Nothing overlaps the prefill of a stream that drafts in its own process, and what a one-token
    pass costs is what every draft is weighed against: its first step decodes alone, and its next
    drafts only if a draft pays by that. Taken at the prefill's cost instead, a pass made drafts
    look free: a llama.cpp target here (a token 32 ms, a drafted level 25, the prefill 660) drafted 10
    levels at its first step, about 480 ms with the prompt's ingest, and made 0.93x decoding alone
    over 8 HumanEval answers in replay (bench depth-replay)."""
    seen = []

    class Recorded(DepthPolicy):
        def choose(self, limit: int, source: Source = Source(), before_prefill: bool = False) -> Decision:
            decision = super().choose(limit, source, before_prefill)
            seen.append((self.prefill_ms, decision.depth))
            return decision

    gen = speculative(tiny_target, tiny_drafters["good"], [5, 9, 2, 7, 1], 12, DraftConfig(depth=4),
                      SamplingConfig(), policy=Recorded(4))
    assert seen[0][0] > 0 and seen[0][1] == 0 and gen.depths[0] == 0
    for token_ms, drafts in ((32.0, False), (165.0, True)):  # llama.cpp; transformers, about flat to 11 tokens
        policy = DepthPolicy(10)
        policy.server_prior(40.0 if not drafts else 23.0)
        policy.prefill(660.0)
        inline = Source(inline=True, stops=True)
        assert policy.choose(127, inline).depth == 0
        policy.observe(0, 0, None, 1, token_ms)
        assert policy.choose(127, inline).depth == (10 if drafts else 0)


def scripted(policy: DepthPolicy, limit: int, source: Source, depth: int) -> Decision:
    """A decision to draft `depth` deep, with the deadline the rule would give it."""
    return Decision(depth, policy.situation(limit, source).deadline_ms(depth) if depth else 0.0)


def test_a_streams_first_draft_ingests_the_prompt_and_is_no_draft_time(tiny_target, tiny_drafters):
    """Whichever step asks a stream's first draft, the drafter ingests the prompt with it: its wait
    is not what a draft costs (taken for one, a drafted level looked 200 ms dear here)."""
    class Ingesting(Drafter):
        ingested = False

        def propose(self, seq, new_tokens, cfg, *args, **kwargs):
            if not self.ingested:
                time.sleep(0.2)  # a long prompt's ingest
                self.ingested = True
            return super().propose(seq, new_tokens, cfg, *args, **kwargs)

    class Late(DepthPolicy):  # decodes its first two steps alone, then drafts
        def choose(self, limit: int, source: Source = Source(), before_prefill: bool = False) -> Decision:
            self.steps += 1
            return scripted(self, limit, source, 0 if self.steps <= 2 else min(limit, 4))

    policy = Late(4)
    gen = speculative(tiny_target, Ingesting(tiny_drafters["good"].model), [5, 9, 2, 7, 1], 8, DraftConfig(depth=4),
                      SamplingConfig(), policy=policy)
    assert gen.depths[:2] == [0, 0] and any(gen.depths[2:])
    assert policy.draft_ms.samples and max(max(v) for v in policy.draft_ms.samples.values()) < 150


def test_a_target_measures_its_verify_costs_before_its_first_stream(tiny_target, tiny_drafters):
    """What a pass of each width costs, measured on a throwaway stream, three times each (a width's
    median then counts for good); the streams after it decode as they would have."""
    policy = DepthPolicy(10)
    costs = measure_verify(tiny_target, policy)
    assert list(costs) == [1, 2, 3, 5, 8, 11] and all(ms > 0 for ms in costs.values())
    assert all(policy.verify_ms.measured(w) == 3 for w in costs) and policy.steps == 0
    cfg = DraftConfig(depth=10)
    gen = speculative(tiny_target, tiny_drafters["good"], [5, 9, 2, 7, 1], 24, cfg, SamplingConfig(), policy=policy)
    assert gen.token_ids == target_only(tiny_target, [5, 9, 2, 7, 1], 24, SamplingConfig()).token_ids


def one_core_table() -> Costs:
    """A llama.cpp target on one core of this CPU (119 ms for 2 tokens, 188 for 4, 51 for one)."""
    return measured_table({1: 51, 2: 119, 3: 160, 4: 188, 9: 388})


def test_no_look_at_a_depth_that_could_not_pay_even_with_every_token_accepted():
    """A look at drafting, while decoding alone, tries the depth that pays best by the stream's
    means: on one core, once the first look has measured 60 ms a level to wait for, one level. But
    one drafted token costs a 119 ms pass against 51 for decoding alone: even accepted every time
    and free, it loses (2/119 < 1/51), so such a look would only measure a loss, and none is made."""
    table = one_core_table()
    policy = DepthPolicy(8, explore=16, verify_ms=table)
    chosen = run(policy, 256, 0, 0, draft_per_level=60, wait_ms=0, right=3, verify=table)
    assert chosen.count(0) == 255 and not any(chosen[32:])
    cheap = DepthPolicy(8, explore=16, verify_ms=one_core_table())  # verifying 2 tokens as dear as 1: a look
    cheap.verify_ms.samples[2] = cheap.verify_ms.samples[1]
    cheap.verify_ms._values = None
    assert any(run(cheap, 256, 0, 0, draft_per_level=60, wait_ms=0, right=3, verify=cheap.verify_ms)[16:])


def slow_target() -> Costs:
    """A target whose pass costs 100 ms for 1 to 5 tokens: against it the tiny draft's levels are free."""
    return measured_table({1: 100, 5: 100})


def llamacpp_table() -> Costs:
    """The 1.5B target on llama.cpp, both cores of this CPU (ms by tokens scored, measured)."""
    return measured_table({1: 31, 2: 50, 4: 85, 8: 148, 12: 178})


def test_no_look_at_a_depth_whose_draft_in_this_process_could_not_pay():
    """A drafter in this process costs its compute at every look, as a co-hosted server does: on two
    cores beside a llama.cpp target, the 0.5B draft costs about 40 ms a level against 31 ms for the
    target's token. Even accepted every time, one drafted token costs 40 + 50 ms for 2 tokens against
    31 for one alone: no look is made. A server's draft, whose wait may shrink, is still looked at."""
    inline = DepthPolicy(8, explore=16, verify_ms=llamacpp_table())
    assert run(inline, 256, 0, 0, draft_per_level=40, wait_ms=0, right=3, verify=inline.verify_ms,
               source=Source(inline=True))[2:].count(0) == 254
    served = DepthPolicy(8, explore=16, verify_ms=llamacpp_table())
    assert any(run(served, 256, 0, 0, draft_per_level=40, wait_ms=0, right=3, verify=served.verify_ms)[16:])


def test_a_stream_drafting_in_this_process_takes_the_drafters_cost_per_level(tiny_target, tiny_drafters):
    """A fresh policy drafting in this process (`starsd generate`) knows nothing of what a draft
    costs, and its first draft's time, which ingested the prompt, tells nothing of it: it took drafts
    as free and drafted 10 deep at its next draft, a loss on a llama.cpp target. It takes the
    drafter's own figure per level instead (Drafter.level_ms, measured on its last drafts), before
    its first step when the drafter has one, else after its first draft."""
    drafter = Drafter(tiny_drafters["good"].model)
    prompt = [5, 9, 2, 7, 1]
    cfg = DraftConfig(depth=4, min_path_prob=0.0)
    policy = DepthPolicy(4, verify_ms=slow_target())
    speculative(tiny_target, drafter, prompt, 12, cfg, SamplingConfig(), policy=policy)
    assert drafter.levels  # against a slow target it drafts at once: its first draft fed levels
    assert policy.draft_ms.prior == pytest.approx(max(1.0, drafter.levels[0]))
    drafter.levels.extend([250.0] * 9)  # as if its levels had cost 250 ms each of late
    policy = DepthPolicy(4, verify_ms=slow_target())
    gen = speculative(tiny_target, drafter, prompt, 12, cfg, SamplingConfig(), policy=policy)
    assert policy.draft_ms.prior == pytest.approx(250.0)
    assert gen.token_ids == target_only(tiny_target, prompt, 12, SamplingConfig()).token_ids


def test_no_look_at_drafting_makes_a_cohosted_server_ingest_a_prompt():
    """A co-hosted server that holds none of a stream (no draft of it was asked) would ingest the
    whole prompt for a look, on the cores the targets verify on (about a second of a core for 130
    tokens of the 0.5B draft here): none is made. Once it holds the stream, looks come as usual."""
    def chosen(holds: bool) -> list[int]:
        return run(DepthPolicy(8, explore=16), 128, decode_ms=100, verify_per_token=5, draft_per_level=150,
                   wait_ms=0, right=3, share_per_level=5, source=Source(cohosted=True, holds=holds))

    apart = chosen(holds=False)
    assert apart[0] == 8 and apart[1:].count(0) == 127  # its first draft: where a stream's first step asks one
    held = chosen(holds=True)
    assert held[0] == 8 and any(held[16:])


def test_a_move_to_another_server_voids_what_the_last_one_taught():
    """Drafts that pay, then the server dies with a draft in flight: its deadline is missed twice,
    and the stream pauses. Its session moves to another server: the pause and the dead server's
    draft costs go, the new one's figure per level stands in, and the next step drafts."""
    policy = DepthPolicy(8, explore=16)
    run(policy, 32, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2, right=6)
    for _ in range(3):
        policy.missed(8, 400.0)
    assert policy.paused and policy.choose(8).depth == 0
    assert not policy.follow(0, 5.0) and policy.paused  # the same server
    assert policy.follow(1, 5.0)
    assert not policy.paused and policy.draft_ms.measured(8) == 0 and policy.choose(8).depth > 0


def test_deadline_is_the_wait_speculation_can_win_back():
    policy = DepthPolicy(4)
    for _ in range(20):
        policy.observe(4, 4, 10.0, 5, 200.0)  # every draft fully accepted; verifying 5 tokens: 200 ms
        policy.observe(0, 0, None, 1, 100.0)  # decoding alone: 100 ms
    # (1 + 4 accepted) * 100 ms alone - 200 ms verify = 300 ms: a later draft loses to decoding alone
    assert policy.situation(4).deadline_ms(4) == pytest.approx(300.0, rel=0.02)
    assert decided(policy, 4).deadline_ms == pytest.approx(300.0, rel=0.02)
    assert policy.situation(4).rate(4) == pytest.approx(5 / 210, rel=0.02)


def test_a_missed_deadline_pauses_drafting_longer_each_time_in_a_row():
    policy = DepthPolicy(4, explore=4)
    for _ in range(8):
        policy.observe(4, 2, 5.0, 5, 50.0)
    depths = lambda n: [policy.choose(4).depth for _ in range(n)]
    policy.missed(4, 300.0)
    assert depths(4) == [0] * 4 and policy.choose(4).depth > 0
    policy.missed(4, 300.0)
    assert depths(8) == [0] * 8  # twice as long after a second miss in a row
    policy.choose(4)
    policy.observe(4, 2, 5.0, 5, 50.0)  # a draft in time ends the run of misses
    policy.missed(4, 300.0)
    assert depths(4) == [0] * 4 and policy.choose(4).depth > 0


def test_a_first_miss_before_the_draft_time_is_known_is_a_figure_not_a_pause():
    """Seen through a draft server on this host: a stream's second step asked 9 tokens with a
    deadline of one decode pass (580 ms, from next to no figures), missed it, and decoded alone for
    16 steps before it drafted, then accepted 3 of 3, 6 of 6 and 10 of 10."""
    policy = DepthPolicy(10, explore=16)
    policy.observe(1, 0, None, 2, 578.0)
    policy.missed(9, 580.0)
    assert policy.paused == 0 and policy.draft_ms(9) == pytest.approx(580.0)
    policy.missed(9, 600.0)  # a second in a row: the server is slow after all (the pause of a second miss)
    assert policy.paused == 32


def test_first_deadline_trusts_the_server_as_long_as_the_prefill_took():
    policy = DepthPolicy(4)
    policy.prefill(2000.0)
    assert decided(policy, 4).deadline_ms > 2000.0  # no pass measured yet: (1 + accepted) * 2 s - 2 s
    policy.observe(4, 1, 5.0, 5, 100.0)
    policy.prefill(9000.0)  # a pass is measured: the prefill no longer stands in for it
    assert decided(policy, 4).deadline_ms < 1000.0


def test_a_draft_already_here_is_verified_as_deep_as_pays_without_a_wait():
    """A slow server (a 2 s wait never pays) but a cheap verify and a draft right for three tokens:
    waiting, the stream decodes alone; a draft that arrived while it did is worth verifying 3 deep,
    and so it asks ahead one deeper (this step commits a token before the draft can be used)."""
    policy = learnt(right=3)
    assert policy.choose(8).depth == 0
    assert policy.worth(8) == 3 and policy.worth(2) == 2 and policy.worth(0) == 0
    assert decided(policy, 8).ahead == 4 and decided(policy, 3).ahead == 3


def test_a_draft_asked_ahead_of_a_server_on_this_host_costs_its_compute():
    """A server on this host drafts on the cores the targets verify on: a draft nobody waits for is
    not free there. 100 ms a token alone, 5 more a drafted token, drafts right for three tokens, but
    150 ms of the server's compute a level: a draft already here is worth verifying, yet none is asked
    ahead, where one would be of a server on another host; at 5 ms a level, it is. What counts is the
    server's compute, not the wait: a server 2 s away that computes 5 ms a level is asked ahead."""
    dear = DepthPolicy(8, explore=16)
    run(dear, 64, decode_ms=100, verify_per_token=5, draft_per_level=150, wait_ms=0, right=3, share_per_level=150,
        source=Source(cohosted=True))
    assert decided(dear, 8, cohosted=True).depth == 0 and dear.worth(8) > 0
    assert decided(dear, 8, cohosted=True).ahead == 0
    assert decided(dear, 8).ahead > 0  # of a server on another host
    far = DepthPolicy(8, explore=16)
    run(far, 64, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2000, right=3, share_per_level=5,
        source=Source(cohosted=True))
    far_ahead = decided(far, 8, cohosted=True)
    assert far_ahead.depth == 0 and far_ahead.ahead > 0


def test_a_cohosted_server_is_asked_no_first_draft_while_drafting_does_not_pay():
    """A prompt's first draft has the server ingest the whole prompt: on this host's cores, for a
    stream whose waited drafts do not pay (150 ms a level to wait for), none is asked, though the
    draft's own compute (5 ms a level) would pay asked ahead; of a server elsewhere it is asked."""
    policy = DepthPolicy(8, explore=16)
    run(policy, 64, decode_ms=100, verify_per_token=5, draft_per_level=150, wait_ms=0, right=3, share_per_level=5,
        source=Source(cohosted=True))
    policy.prefill(500.0)
    assert decided(policy, 8, cohosted=True).ahead > 0 and decided(policy, 8, True, cohosted=True).ahead == 0
    assert decided(policy, 8, True).ahead > 0


def test_no_draft_is_asked_ahead_where_even_a_free_one_loses():
    """This CPU's verify costs (test above) and a draft whose first token is right 9 times in 10:
    even with no wait, one drafted token gives 1.9 tokens per 1214 ms against 1 per 619 alone, and
    deeper is worse, so a stream that decodes alone does not load the server with asks either."""
    table = Costs(0.0)
    for w, ms in {1: 619, 2: 1214, 4: 1962, 11: 2499}.items():
        for _ in range(3):
            table.add(w, ms)
    policy = DepthPolicy(8, explore=16, verify_ms=table)
    for i in range(200):
        policy.observe(2, int(i % 10 != 0), 5.0, 3, table(3))
    assert policy.worth(8) == 0 and decided(policy, 8).ahead == 0


def test_no_draft_is_asked_ahead_whose_first_levels_would_likely_differ_from_what_comes_before_it():
    """Seen on an AMX Xeon (bench elastic): 32 replay targets on two servers asked 10 levels ahead at 1,932
    steps of a run, each draft several tokens late, and 14 were taken: a late draft is used only if its first
    levels are the tokens committed before it came, and the servers, busy 96% of the time, answered late
    the drafts that were waited for. A server 480 ms away (5 tokens at 100 ms each): drafts right for
    three tokens are not asked ahead, drafts right for eight are; and one in time is asked either way."""
    three, eight = learnt(right=3), learnt(right=8)
    away = dict(server_ms=400.0, pace_ms=10.0)
    assert decided(three, 8, **away).late == "held" and decided(eight, 8, **away).late == "timely"
    assert decided(three, 8).late == "timely" and decided(three, 8).ahead > 0


def test_a_stream_that_measured_little_still_asks_ahead_now_and_then():
    """Whether a late draft would be taken is judged on one Thompson draw of the acceptance: a stream
    whose two drafts were poorly accepted (both rejected at once) still asks ahead now and then, though
    a draft a token late is taken only if its first token is right, and so measures more; one that
    measured 128 such drafts does not. Judged
    on the means, the first never asked again: of two targets at one server (bench elastic), one
    decoded alone for 120 s after its first answer's two drafts."""
    def stream(drafts: int) -> DepthPolicy:
        policy = DepthPolicy(8, explore=16)
        for w, ms in {1: 220, 2: 222, 5: 226, 9: 230}.items():
            for _ in range(3):
                policy.verify_ms.add(w, ms)
        for _ in range(drafts):
            policy.observe(3, 0, 300.0, 4, 222.0, asked=3)
        return policy

    away = Source(server_ms=40.0, pace_ms=20.0, holds=True, unsent=1)  # 200 ms for 8 levels: a token late
    asks = lambda policy: sum(policy.choose(8, away).late == "timely" for _ in range(200))
    assert asks(stream(2)) >= 5 and asks(stream(128)) == 0


def test_a_stream_that_drafts_asks_its_prompts_ingest_before_the_prefill_however_late_its_draft():
    """A stream whose drafts pay needs its prompt ingested whatever the first draft's timing: a level is
    asked before the prefill, which hides the ingest, though a deeper first draft would come too late."""
    policy = DepthPolicy(8, explore=16)
    run(policy, 64, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2, right=8)
    policy.prefill(100.0)
    first = decided(policy, 8, True, pace_ms=40.0, unsent=150, ingest_ms=10.0)
    assert first.depth > 0 and first.ahead == 1


def test_no_draft_is_asked_ahead_that_would_come_too_late_but_now_and_then_one_is():
    """As above (a draft right for three tokens, 100 ms a token alone), but the server takes 2 s on
    a request: 20 tokens pass before a draft at most 8 deep comes, so none is asked but a probe (one
    level: its reply tells the server's queue, a deeper one would only cost it more) 16 steps on, then
    32, 64 and 128 apart (and the looks at drafting, asked ahead too, ever more rarely); once the server's replies say 150 ms (two tokens), drafts are asked ahead at every step
    again."""
    policy = learnt(right=3)
    decisions = [policy.choose(8, Source(server_ms=2000.0)) for _ in range(400)]
    probes = [i for i, d in enumerate(decisions) if d.late == "probe"]
    gaps = [b - a for a, b in zip(probes, probes[1:])]  # (a step whose look is asked ahead is not counted)
    assert [round(g / 32) for g in gaps] == [1, 2, 4, 4] and not any(d.depth for d in decisions)
    assert all(d.ahead == 1 for d in decisions if d.late == "probe")
    asked = [i for i, d in enumerate(decisions) if d.ahead]
    assert len(asked) <= 12 and set(probes) <= set(asked)
    looked = policy.choose(8, Source(server_ms=150.0))  # the server frees up: a look at once, waited for
    assert looked.look == "drafting" and looked.depth
    timely = policy.choose(8, Source(server_ms=150.0))  # 6 levels left after two tokens: 3 of them pay
    assert (timely.ahead, timely.late) == (4, "timely") and policy.late_probes == 0  # back to 16 steps apart


def test_a_prompts_first_draft_is_asked_only_if_it_can_come_in_time_with_the_prefills_head_start():
    """As above, drafts right for all 8 tokens: a server 2 s behind, 100 ms a token alone. A 1.5 s
    prefill leaves five tokens of wait, so the first draft of a new prompt is asked, as deep as allowed
    (its levels after those five pay); a 100 ms prefill leaves 19, and none is asked (the server would
    only ingest the prompt for a draft nobody takes)."""
    policy = learnt(right=8)
    policy.prefill(1500.0)
    assert decided(policy, 8, True, server_ms=2000.0).ahead == 8
    policy.prefill(100.0)
    assert decided(policy, 8, True, server_ms=2000.0).ahead == 0
    assert decided(policy, 8, True, lateness=20.0).ahead == 0  # drafts that come 20 tokens late, for another reason


def test_a_prompts_first_draft_waits_for_its_prompts_ingest_too():
    """Seen on an AMX Xeon (bench elastic at 71ed413): at 32 targets on two servers busy 86-88% of the
    time, none of 364 answers verified a draft at its first step, and in a run of the same tree (not
    kept) each server had ingested about 9,000 prompt tokens in first drafts over the phase. A first
    draft is weighed by the server's queue and levels less the prefill's head start, as above, and also
    by the server's ingest of the prompt it lacks: 150 tokens at 10 ms each leave it too late to pay.
    A stream that asked none drafts from its next look all the same, the server having ingested the
    prompt asked ahead (a catch-up), and waits for no draft that ingests more than a step's tokens."""
    policy = learnt(right=8)
    policy.prefill(1500.0)
    assert decided(policy, 8, True, server_ms=2000.0, unsent=150, ingest_ms=0.0).ahead == 8
    assert decided(policy, 8, True, server_ms=2000.0, unsent=150, ingest_ms=10.0).ahead == 0
    assert decided(policy, 8, True, server_ms=2000.0, unsent=8, ingest_ms=10.0).ahead == 8  # a step's own
    fresh = DepthPolicy(8, explore=16)
    run(fresh, 64, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2, right=3)
    chosen, ingested = alone_after_load(fresh, 64, ingest_ms=10.0, prompt=150)
    assert sum(map(bool, chosen)) >= 0.8 * len(chosen) and max(ingested) <= 9


def test_a_cohosted_draft_is_charged_to_every_other_target_on_the_cores():
    """Seen on an AMX Xeon: a local star of two llama.cpp targets (one thread each on the 2 cores) and
    its draft server. The targets measured 164 ms for one token, 209 for two, 257 for three; the
    server's level took 46 ms. By the prior acceptance (0.8) one drafted token looked worth 1.16x to a
    stream (1.8 tokens per 255 ms against 1 per 164), so streams drafted, the server ingested their
    prompts, and both targets ran at 0.65-0.78x decoding alone. Its compute slows the other target
    too: charged once more for it (1.8 per 301 ms), no draft pays, none is asked before the prefill
    (whose ingest would take the cores too), and no look at drafting is made."""
    def stream() -> DepthPolicy:
        policy = DepthPolicy(10, explore=16)
        policy.server_prior(46.0)
        for w, ms in {1: 164, 2: 209, 3: 257, 5: 387, 8: 569, 11: 562}.items():
            for _ in range(3):
                policy.verify_ms.add(w, ms)
        policy.prefill(300.0)
        return policy

    first = stream().choose(10, Source(cohosted=True), before_prefill=True)
    assert first.depth > 0 and first.ahead > 0
    beside = Source(cohosted=True, neighbours=1)
    assert stream().choose(10, beside, before_prefill=True).ahead == 0
    assert run(stream(), 64, decode_ms=164, verify_per_token=45, draft_per_level=46, wait_ms=0, right=1,
               share_per_level=46, source=beside) == [0] * 64


def test_a_first_draft_pays_back_the_prompt_it_has_a_cohosted_server_ingest():
    """Seen on an AMX Xeon: a local star of two llama.cpp targets whose verify costs, measured on a
    loaded host, made a draft look a little worth it. A stream's first draft had the server ingest
    its HumanEval prompt (about a second of its time on the shared cores) for one drafted step of 122: 0.87x decoding
    alone, the server 25% busy. A draft that wins 11 ms a token saves 0.7 s over 64 tokens, less
    than 150 prompt tokens at 7 ms each, taken from this target and its neighbour: the stream
    decodes alone. It drafts where the server holds its tokens, where the answer is long enough to
    pay the ingest back, or where the ingest's cost is not known."""
    def choice(unsent: int, tokens: int, ingest_ms: float = 7.0) -> int:
        policy = DepthPolicy(10, explore=16, steps=5)
        policy.server_prior(20.0)
        for w, ms in {1: 110, 2: 140, 3: 160, 5: 200, 8: 260, 11: 320}.items():
            for _ in range(3):
                policy.verify_ms.add(w, ms)
        source = Source(cohosted=True, neighbours=1, inline=True, unsent=unsent, ingest_ms=ingest_ms)
        return policy.choose(tokens - 1, source).depth

    assert choice(150, 64) == 0
    assert choice(0, 64) > 0 and choice(150, 2000) > 0 and choice(150, 64, ingest_ms=0.0) > 0
    assert choice(11, 64) > 0  # a step's own tokens (at most max_depth + 1): what every draft carries


def test_a_stream_tells_its_policy_what_the_drafter_lacks(tiny_target, tiny_drafters):
    """Before each choice the decode loop says how many tokens the drafter does not hold: the whole
    prompt (and what was decoded alone) until a first draft, then the tokens since the last one."""
    seen: list[tuple[bool, int]] = []

    class Watched(DepthPolicy):  # decodes its first two steps alone, then drafts
        def choose(self, limit: int, source: Source = Source(), before_prefill: bool = False) -> Decision:
            seen.append((source.holds, source.unsent))
            self.steps += 1
            return scripted(self, limit, source, 0 if self.steps <= 2 else min(limit, 3))

    prompt = [5, 6, 7, 8, 9]
    speculative(tiny_target, tiny_drafters["good"], prompt, 12, DraftConfig(depth=3), SamplingConfig(),
                policy=Watched(3))
    assert seen[:3] == [(False, 5), (False, 6), (False, 7)] and len(seen) > 4
    assert all(unsent <= 4 for holds, unsent in seen if holds)  # a step emits at most depth + 1 tokens


def costed(verify: dict[int, float], level_ms: float) -> DepthPolicy:
    """A stream that has measured its verify passes by width and its drafts' levels, and whose drafts
    were right for their first 6 tokens of 10 (drafted 10 deep)."""
    policy = DepthPolicy(10, verify_ms=measured_table(verify))
    for _ in range(3):
        for d in (2, 5, 9):
            policy.draft_ms.add(d, level_ms * d)
    for _ in range(20):
        policy.acceptance.add(10, 6)
    return policy


def test_a_chain_stops_where_one_more_level_no_longer_pays():
    """One more level pays while its path's chance of being accepted beats its cost (a drafted level
    and one more verified token) in tokens at the stream's rate. A llama.cpp target on a CPU pays
    a good part of a token's time for each token it verifies (117 ms for one, 244 for 5 on an AMX
    Xeon): its chains stop early; a transformers target on a CPU verifies 1 to 11 tokens in about
    one pass's time: they run on; with a level nearly free against a target pass (a GPU), on further
    still. A fixed 0.3 fit none of them."""
    stop = lambda verify, level_ms: decided(costed(verify, level_ms), 10).stop
    llamacpp = stop({w: 117 + 32 * (w - 1) for w in (1, 2, 3, 5, 8, 11)}, 38.5)
    transformers = stop({1: 200, 2: 201, 5: 203, 11: 210}, 38.0)
    gpu = stop({1: 30, 11: 31}, 1.0)
    assert gpu < 0.3 < transformers < llamacpp <= MAX_STOP
    assert stop({1: 100, 11: 100}, 1000.0) == MAX_STOP  # a level dearer than all it could win


def test_each_draft_stops_where_the_policy_says_unless_told_to_stop_at_min_path_prob(tiny_target, tiny_drafters):
    """The decoding loop gives each draft the policy's threshold of the step (auto_stop), or the
    configured one (auto_stop off, or no policy)."""
    class Told(Drafter):
        def propose(self, seq, new_tokens, cfg, *args, **kwargs):
            stops.append((cfg.min_path_prob, policy.situation(4).stop()))
            return super().propose(seq, new_tokens, cfg, *args, **kwargs)

    drafter = Told(tiny_drafters["good"].model)
    prompt = [5, 9, 2, 7, 1]
    for auto in (True, False):
        stops = []
        policy = DepthPolicy(4, verify_ms=slow_target())
        cfg = DraftConfig(depth=4, min_path_prob=0.3, auto_stop=auto)
        gen = speculative(tiny_target, drafter, prompt, 24, cfg, SamplingConfig(), policy=policy)
        assert gen.token_ids == target_only(tiny_target, prompt, 24, SamplingConfig()).token_ids
        told, chosen = zip(*stops)
        assert told == (chosen if auto else (0.3,) * len(told))


def test_a_look_at_a_server_too_slow_to_pay_is_asked_ahead_not_waited_for():
    """A stream decoding alone, its drafts right for three tokens, 100 ms a token alone, at a server
    whose own time on a request is 2 s (a queue behind 31 other targets): even a perfect draft waited
    for that long loses, so no step waits for a look; each look is a draft asked ahead instead, and
    its reply tells whether the server has freed up. With the server at 0 ms, looks are waited for."""
    policy = learnt(right=3)
    chosen, asked = [], []
    for _ in range(300):
        decision = policy.choose(8, Source(server_ms=2000.0))
        chosen.append(decision.depth)
        asked.append(decision.ahead)
        policy.observe(0, 0, None, 1, 100.0)
    assert not any(chosen) and sum(bool(a) for a in asked) >= 4
    assert any(policy.choose(8).depth for _ in range(300))


def test_a_stream_that_joins_a_saturated_server_does_not_wait_for_its_drafts():
    """A new stream (its draft cost a prior of 34 ms a level, the server's unloaded figure) at a
    server whose requests wait 3 s (32 replay targets on an AMX Xeon): even a perfect draft waited
    for that long loses to decoding alone at 200 ms a token, so no step waits for one (each of the
    first five had waited 0.7 to 2.3 s for a draft that never came in time). At a server answering
    in 300 ms the same stream drafts."""
    def stream(server_ms: float) -> list[int]:
        policy = DepthPolicy(10, explore=16, verify_ms=measured_table({1: 200, 11: 230}))
        policy.server_prior(34.0)
        return [policy.choose(63, Source(server_ms=server_ms)).depth for _ in range(64)]

    assert not any(stream(3000.0)) and sum(map(bool, stream(300.0))) > 32


def alone_after_load(policy: DepthPolicy, steps: int, ingest_ms: float = 9.0, lateness: float = 1.0,
                     prompt: int = 0) -> tuple[list[int], list[int]]:
    """A stream at a server whose load has gone (no queue, 40 ms a level, 9 ms a token ingested), its
    drafts right for three tokens, 100 ms a token alone: each step's depth, and the tokens each draft
    waited for had the server ingest first (the drafter lacks what the stream decoded alone). `prompt`:
    the server does not hold the stream, whose prompt was this long (no first draft was asked)."""
    unsent, holds, chosen, ingested = prompt or 1, not prompt, [], []
    for _ in range(steps):
        decision = policy.choose(8, Source(server_ms=0.0, pace_ms=40.0, holds=holds, unsent=unsent,
                                           ingest_ms=ingest_ms, lateness=lateness))
        holds = holds or bool(decision.depth or decision.ahead)
        d = decision.depth
        chosen.append(d)
        if d:
            ingested.append(unsent)
        policy.observe(d, min(d, 3), 40.0 * d + ingest_ms * unsent if d else None, d + 1, 100.0 + 5 * d)
        unsent = min(d, 3) + 1 if d or decision.ahead else unsent + 1
    return chosen, ingested


def test_a_stream_alone_after_a_load_that_has_gone_drafts_again_at_its_next_look():
    """Seen on an AMX Xeon (bench elastic): of two targets left when 30 went, one never drafted again in
    130 s. Its figures were of the loaded server (2 s a draft), and it asked drafts ahead only as probes,
    once or twice a prompt (here: its replies taken as 30 tokens late). Its one look in a prompt waited 723 ms for 2 levels: the server first ingested what it
    lacked. Here a look has the server catch up first, a level asked ahead, and waits for a
    draft at the next step; that draft, fast, voids the old figures, and the stream drafts from its
    next look on. No draft it waits for ingests more than a step's tokens. With the catch-up off, its
    look's draft ingests 32 tokens and the stream decodes alone to the end."""
    policy = learnt(right=3)
    assert not any(run(policy, 16, decode_ms=100, verify_per_token=5, draft_per_level=5, wait_ms=2000, right=3))
    chosen, ingested = alone_after_load(policy, 160, lateness=30.0)
    first = next(i for i, d in enumerate(chosen) if d)
    assert first <= policy.explore << 4 and sum(map(bool, chosen[first:])) >= 0.8 * len(chosen[first:])
    assert max(ingested) <= 9  # at most max_depth + 1: a step's own


def test_a_look_comes_at_once_when_a_server_too_slow_at_the_last_one_frees_up():
    """Seen on an AMX Xeon (bench elastic, at 2a0e79e): of two targets left when 30 went, one decoded
    alone for about 90 s more. At 32 targets its looks had found the server too slow and been asked ahead,
    each doubling the wait for the next, to 256 steps. A stream whose last look found the server too
    slow looks again as soon as the server's word says a look could pay (with the rule off: 103 steps
    on, here)."""
    policy = learnt(right=3)
    for _ in range(600):  # the server too slow: looks are probes, ever more rarely
        policy.choose(8, Source(server_ms=2000.0, pace_ms=40.0, holds=True))
        policy.observe(0, 0, None, 1, 100.0)
    assert policy.probed and policy.idle_looks >= 4
    chosen = [policy.choose(8, Source(server_ms=0.0, pace_ms=40.0, holds=True)) for _ in range(2)]
    assert chosen[0].look == "drafting" and chosen[0].depth


def test_missed_deadlines_in_a_row_never_wait_more_than_twice_what_a_draft_could_win():
    """A draft that misses its deadline counts as having taken it, and a deadline allows twice a draft's
    expected time: each miss in a row doubled the next wait. Seen on an AMX Xeon (bench elastic, 32
    replay targets on two servers, 230 ms a token alone): waits of 1.6 s, then 3.2 s, for drafts that
    never came. The wait stays within twice what a draft could win (here 3 tokens of 8 accepted)."""
    policy = DepthPolicy(8, explore=16, verify_ms=measured_table({1: 230, 9: 232}))
    for _ in range(20):
        policy.acceptance.add(8, 3)
    waits = []
    for _ in range(6):
        s = policy.situation(8)
        waits.append(s.deadline_ms(8))
        policy.missed(8, waits[-1])
    levels, accepted = s.expect(8)
    pays = (1 + accepted) * 230 - 232
    assert waits[0] == pytest.approx(pays, rel=0.01) and max(waits) <= 2 * pays + 1


def test_drafts_that_miss_their_deadline_often_enough_to_lose_are_not_waited_for():
    """Seen on an AMD EPYC (bench elastic, 32 replay targets on two servers): 20% of the drafts waited for
    missed their deadline, each miss waiting 750 ms beyond the pass where a hit won 150 ms, and the 32 lost
    more to the misses than they won. A miss waits out its deadline and verifies one token, and its chance
    (the misses among the drafts waited for over the last MISS_STEPS steps) counts: here hits win a
    little (two tokens right, 100 ms a level, 210 ms a token alone), and the stream drafts while they
    come, not once half its last drafts missed, and again once those misses are MISS_STEPS steps old."""
    policy = DepthPolicy(8, explore=16)
    run(policy, 64, decode_ms=210, verify_per_token=4, draft_per_level=100, wait_ms=0, right=2)
    assert decided(policy, 8).depth and policy.miss_chance() == 0
    policy.waited.clear()
    for k in range(8):  # its last 8 drafts waited for, every other one missed
        policy.waited.append((policy.steps, k % 2 == 0))
    assert policy.miss_chance() == pytest.approx(0.4)
    assert decided(policy, 8).depth == 0
    policy.steps += MISS_STEPS
    assert policy.miss_chance() == 0 and decided(policy, 8).depth

