"""The balancer's verdict on a cheaper step when the windows cannot settle it, and the second
look at a kept step as its windows add up (:mod:`feedgpu.balancer.verdict`,
rule 4 of :mod:`feedgpu.balancer.policy`).

The numbers are those of ``cnn-all`` in ``bench/results/archive/balancer_aba.md``: a model trained on
the CPU with both threads next to the workers, one worker training 585/s with the loop waiting
29 % of its step time, two workers 620/s waiting 2 %, single 1 s windows spreading ~10 %.
"""
from __future__ import annotations

import itertools
import math

import pytest

from feedgpu.balancer import Measurement, Policy, PolicyConfig, Record
from feedgpu.balancer.verdict import is_close, stalls_below, verdict


def m(t, workers, rate, wait, prefetch=2, cores=0.0) -> Measurement:
    return Measurement(t=t, workers=workers, delivered_rate=rate, demand_rate=rate / (1 - wait),
                       wait_fraction=wait, cpu_cores_used=cores, cpu_budget=2.0, prefetch=prefetch)


def record(rates, wait, workers) -> Record:
    r = Record()
    for i, x in enumerate(rates):
        r.add(m(i, workers, x, wait))
    return r


def name(key) -> str:
    return f"{key[0]}w/p{key[1]}"


TWO, ONE = (2, 2), (1, 2)
TWO_RATES = [560, 680, 600, 650, 590, 640]     # mean 620
ONE_RATES = [600, 530, 640, 560, 600, 580]     # mean 585, -5.6 %


def test_a_close_call_where_the_loop_stalls_must_train_within_the_tolerance_of_where_it_came_from():
    c = PolicyConfig()
    recs = {TWO: record(TWO_RATES, 0.02, 2), ONE: record(ONE_RATES, 0.29, 1)}
    v = verdict(c, recs, TWO, ONE, "remove", 0.10, name)
    assert is_close(v, c.confidence) and not v.ok, v
    assert "waits 29.0 % of its step time there vs 2.0 % at 2w/p2" in v.why and "-5.6% vs 2w/p2" in v.why, v.why
    # the same rates without the stall: the best's lowered mean is the bar, and 585/s passes it
    recs[ONE] = record(ONE_RATES, 0.02, 1)
    v = verdict(c, recs, TWO, ONE, "remove", 0.10, name)
    assert is_close(v, c.confidence) and v.ok, v
    # a stall alone refuses nothing within the tolerance of where the step came from
    recs[ONE] = record([x + 25 for x in ONE_RATES], 0.29, 1)        # 610/s, -1.6 %
    assert verdict(c, recs, TWO, ONE, "remove", 0.10, name).ok
    # and a clear call is the bar's alone
    recs[ONE] = record(ONE_RATES, 0.29, 1)
    v = verdict(c, recs, TWO, ONE, "remove", 0.005, name)
    assert not is_close(v, c.confidence) and not v.ok and "waits" not in v.why


def test_stalls_below():
    c = PolicyConfig()
    a = record([620] * 3, 0.02, 2)
    assert stalls_below(c, a, record([585] * 3, 0.29, 1))
    assert not stalls_below(c, a, record([585] * 3, 0.04, 1))    # waits 2 points more: not a stall
    assert not stalls_below(c, a, record([605] * 3, 0.29, 1))    # -2.4 %: within the tolerance


def drive(policy: Policy, rates: dict, waits: dict, windows: int, start=TWO, spread=(1.0,)):
    """Windows at whatever setting the policy decides, each at ``rates`` of that setting times
    the next factor of ``spread`` (cycled)."""
    key, decisions = start, []
    for t in range(windows):
        f = spread[t % len(spread)]
        d = policy.decide(m(t, key[0], rates[key] * f, waits[key], prefetch=key[1]))
        decisions.append(d)
        key = (d.workers, d.prefetch)
    return decisions


SPREAD = (0.9, 1.1, 0.97, 1.05, 0.95, 1.03)   # ~6 % a window, the same at every setting


def test_the_policy_keeps_two_workers_when_one_stalls_the_loop_on_a_close_call():
    """cnn-all, round 1 of balancer_aba: without the rule a worker less was kept at -5.6 %."""
    cfg = PolicyConfig(max_workers=2, max_prefetch=2, noise_prior=0.14, noise_floor=0.14)   # its window noise
    rates, waits = {TWO: 620.0, ONE: 585.0}, {TWO: 0.02, ONE: 0.29}
    ds = drive(Policy(cfg), rates, waits, 40, spread=SPREAD)
    assert (ds[-1].workers, ds[-1].prefetch) == TWO, ds[-1].reason
    exps = [d.experiment for d in ds if d.experiment]
    assert exps and exps[0]["kind"] == "remove" and not exps[0]["kept"], exps
    assert "waits 29.0 % of its step time there" in exps[0]["why"], exps[0]["why"]
    assert sum(d.workers == 1 for d in ds) <= 14          # one experiment: settle + 6 + re-measure
    # the same close call without the stall keeps the worker less (the fewest within the noise)
    ds = drive(Policy(cfg), rates, {TWO: 0.02, ONE: 0.02}, 40, spread=SPREAD)
    assert ds[-1].workers == 1, ds[-1].reason


def test_a_kept_cheaper_step_is_undone_when_its_later_windows_clearly_miss_the_bar():
    """sleep-800, round 1 of balancer_aba: a worker less kept on its first windows (790/s vs
    787/s; the batches in flight still arriving) then trained 697/s over 33 windows against two
    workers' 781/s, and stayed there."""
    cfg = PolicyConfig(max_workers=2, max_prefetch=2)
    two = iter([781, 775, 787] + [781, 776, 786] * 20)
    one = iter([800, 790, 792] + [697, 702, 693] * 20)

    def run(p, one):
        key, ds = TWO, []
        for t in range(60):
            d = p.decide(m(t, key[0], next(two) if key == TWO else next(one), 0.02))
            ds.append(d)
            key = (d.workers, d.prefetch)
        return ds

    ds = run(Policy(cfg), one)
    kept = [i for i, d in enumerate(ds) if d.experiment and d.experiment["kept"]]
    undone = [i for i, d in enumerate(ds) if d.kind == "revert" and "kept before" in d.reason]
    assert kept and undone and undone[0] - kept[0] <= 30, [(d.kind, d.workers, d.reason) for d in ds]
    assert "over" in ds[undone[0]].reason and not ds[undone[0]].experiment["kept"]
    assert all(d.workers == 2 for d in ds[undone[0]:]), "tried again after it was undone"
    # a kept step whose later windows stay within the bar stays kept
    ds = run(Policy(cfg), iter([800, 790, 792] + [770, 776, 772] * 20))
    assert kept and all(d.workers == 1 for d in ds[kept[0]:]), [(d.kind, d.reason) for d in ds]


def test_a_costlier_step_from_the_windows_of_a_drift_is_confirmed_against_fresh_ones():
    """cnn-1t, round 1 of balancer_stall: the rate at two workers / prefetch 2 fell from 727/s to
    576/s for two windows (the machine's speed swung), the records were forgotten, and the
    deeper prefetch tried next met the recovered speed: +48 % on 2 windows against those two,
    kept at once. The old setting's record then starts with a swing that may be over, so the
    step is confirmed against fresh windows there: here it trains the same, and is undone."""
    cfg = PolicyConfig(min_workers=2, max_workers=2, max_prefetch=3)
    P2, P3 = (2, 2), (2, 3)

    def run(slow_from, slow_to):
        p, key, ds = Policy(cfg), P2, []
        for t in range(50):
            rate = 600.0 if key == P2 and slow_from <= t < slow_to else 800.0
            # the loop's own work trains 850/s: it waits for the rest (a slow loader, a longer wait)
            d = p.decide(m(t, key[0], rate, 1 - rate / 850, prefetch=key[1]))
            ds.append(d)
            key = (d.workers, d.prefetch)
        return ds

    ds = run(20, 22)
    forgot = [i for i, d in enumerate(ds) if "records forgotten" in d.reason]
    assert forgot and ds[forgot[0]].prefetch == 3, [(d.kind, d.reason) for d in ds]
    exps = [d.experiment for d in ds[forgot[0]:] if d.experiment]
    assert exps and not exps[0]["kept"] and "measured again after the step" in exps[0]["why"], exps
    assert ds[-1].prefetch == 2, ds[-1].reason
    # prefetch 2 stays slow: the fresh windows confirm the gain, and the deeper prefetch is kept
    ds = run(20, 50)
    kept = [d.experiment for d in ds if d.experiment and d.experiment["kept"]]
    assert ds[-1].prefetch == 3 and kept and "measured again after the step" in kept[0]["why"], ds[-1].reason


def test_after_a_drift_the_step_back_from_a_kept_cheaper_step_is_tried_first():
    """cnn-all, round 3 of balancer_drift_confirm: a worker less was kept on a close call, the
    machine then slowed and the records were forgotten with the second look at that step; the
    deeper prefetch (first, the one worker being idle part of the time) was being confirmed
    when the run ended, two workers not tried again. After the drift two workers train 33 %
    faster than one, a deeper prefetch 4 %."""
    cfg = PolicyConfig(max_workers=2, max_prefetch=3)
    ONE3 = (1, 3)
    # (rate, wait, worker cores) at each setting, before and after the machine slows at window 21
    before = {TWO: (620, 0.02, 1.0), ONE: (605, 0.02, 0.6), ONE3: (600, 0.02, 0.6)}
    after = {TWO: (600, 0.02, 1.0), ONE: (450, 0.30, 0.6), ONE3: (470, 0.28, 0.6)}
    spread = (0.97, 1.03, 0.99, 1.01)
    p, key, ds = Policy(cfg), TWO, []
    for t in range(60):
        rate, wait, cores = (after if t >= 21 else before)[key]
        d = p.decide(m(t, key[0], rate * spread[t % 4], wait, prefetch=key[1], cores=cores))
        ds.append(d)
        key = (d.workers, d.prefetch)
    kept = [i for i, d in enumerate(ds) if d.experiment and d.experiment["kept"]]
    forgot = [i for i, d in enumerate(ds) if "records forgotten" in d.reason]
    assert kept and ds[kept[0]].workers == 1 and kept[0] < 21, [(d.kind, d.reason) for d in ds]
    assert forgot and ds[forgot[0]].kind == "add" and ds[forgot[0]].workers == 2, ds[forgot[0]].reason
    assert "was still being judged" in ds[forgot[0]].reason
    back = [i for i in kept if i > forgot[0]]
    assert back and (ds[back[0]].workers, ds[back[0]].prefetch) == TWO and back[0] - forgot[0] <= 10, \
        [(d.kind, d.workers, d.prefetch, d.reason) for d in ds[forgot[0]:]]
    assert "measured again after the step" in ds[back[0]].experiment["why"]     # confirmed A-B-A
    assert all(d.workers == 2 for d in ds[back[0]:])


THREE = (3, 2)


def own_work(rate: float) -> float:
    """The waiting share of a loop whose own work trains 470/s, at ``rate`` (at least 2 %)."""
    return max(0.02, 1 - rate / 470)


def run_add(rates: dict, windows: int = 90):
    """Two workers busy on two cores with the loop waiting for the rest of its step (a worker
    more is tried; a worker less cannot keep up), as :func:`own_work`: ``rates[key]`` is an
    iterator of window rates."""
    cfg = PolicyConfig(max_workers=3, max_prefetch=2)
    p, key, ds = Policy(cfg), TWO, []
    for t in range(windows):
        rate = next(rates[key])
        d = p.decide(m(t, key[0], rate, own_work(rate), prefetch=key[1], cores=2.0))
        ds.append(d)
        key = (d.workers, d.prefetch)
    return ds


def test_a_kept_worker_more_not_clearly_faster_later_is_measured_against_fresh_windows_and_undone():
    """cnn-all in balancer_long_run (run 3): a third worker kept on a close A-B-A (+3.4 %) stayed
    for 127 windows, until the periodic recheck, training below two. Here three workers look
    6 % faster over their first windows and then train 3.7 % slower: after
    ``second_look_windows`` at three, two are measured afresh, and the step is undone."""
    from itertools import chain, repeat
    rates = {TWO: repeat(414.0), THREE: chain(repeat(440.0, 8), repeat(385.0))}
    ds = run_add(rates)
    kept = [i for i, d in enumerate(ds) if d.experiment and d.experiment["kept"]]
    assert kept and ds[kept[0]].workers == 3, [(d.kind, d.workers, d.reason) for d in ds]
    look = [i for i, d in enumerate(ds) if "afresh once more" in d.reason]
    assert look and ds[look[0]].workers == 2 and "not clearly faster over 24 windows" in ds[look[0]].reason
    undone = [d.experiment for d in ds[look[0]:] if d.experiment]
    assert undone and not undone[0]["kept"] and undone[0]["kind"] == "add", undone
    assert "measured again after the step" in undone[0]["why"], undone[0]["why"]
    assert all(d.workers == 2 for d in ds[look[0]:]), "tried three workers again before the recheck"
    # without the second look (past the window count of this run) three workers stay: the old behaviour
    rates = {TWO: repeat(414.0), THREE: chain(repeat(440.0, 8), repeat(385.0))}
    p = Policy(PolicyConfig(max_workers=3, max_prefetch=2, second_look_windows=1000))
    key, d = TWO, None
    for t in range(90):
        rate = next(rates[key])
        d = p.decide(m(t, key[0], rate, own_work(rate), cores=2.0))
        key = (d.workers, d.prefetch)
    assert d.workers == 3


def test_a_kept_worker_more_clearly_faster_is_not_measured_again():
    from itertools import repeat
    ds = run_add({TWO: repeat(414.0), THREE: repeat(460.0)})
    kept = [i for i, d in enumerate(ds) if d.experiment and d.experiment["kept"]]
    assert kept and all(d.workers == 3 for d in ds[kept[0]:]), [(d.kind, d.workers, d.reason) for d in ds]
    assert not any("afresh once more" in d.reason for d in ds)


def test_the_second_look_at_a_kept_worker_more_is_made_once():
    """Three workers 4 % faster with windows spreading 10 %: a close call at the second look too.
    Two are measured afresh once, the step is kept again on that, and stays (no third look)."""
    from itertools import cycle
    spread = [0.9, 1.1, 0.95, 1.05, 1.0, 0.92, 1.08]
    rates = {TWO: (414.0 * f for f in cycle(spread)), THREE: (430.0 * f for f in cycle(spread[3:] + spread[:3]))}
    ds = run_add(rates, windows=200)
    looks = [i for i, d in enumerate(ds) if "afresh once more" in d.reason]
    assert len(looks) == 1 and ds[looks[0]].workers == 2, [ds[i].reason for i in looks]
    back = [i for i in range(looks[0], len(ds)) if ds[i].experiment]
    assert back and ds[back[0]].experiment["kept"] and ds[back[0]].workers == 3, ds[back[0]].reason
    assert all(d.workers == 3 for d in ds[back[0]:120])     # until the recheck


def test_rejudge_decides_on_the_records_as_they_are():
    from feedgpu.balancer.second_look import AGAIN, DONE, UNDO, WATCH, rejudge
    c = PolicyConfig()
    two = record([414] * 6, own_work(414), 2)
    for rates, noise, want in [
            ([430] * 10, 0.10, WATCH),       # fewer than second_look_windows
            ([460] * 24, 0.01, DONE),        # clearly more than 3 % faster
            ([430] * 24, 0.10, AGAIN),       # +3.9 %: a close call at this noise
            ([390] * 24, 0.01, AGAIN)]:      # clearly slower: measured afresh, not undone on old windows
        three = record(rates, own_work(rates[0]), 3)
        v = verdict(c, {TWO: two, THREE: three}, TWO, THREE, "add", noise, name)
        assert rejudge(c, "add", two, three, v) == want, (rates[0], noise, v)
    one = record([380] * 10, 0.02, 1)                 # a kept worker less, clearly below the bar
    v = verdict(c, {TWO: two, ONE: one}, TWO, ONE, "remove", 0.02, name)
    assert rejudge(c, "remove", two, one, v) == UNDO
    one = record([410] * 10, 0.02, 1)
    v = verdict(c, {TWO: two, ONE: one}, TWO, ONE, "remove", 0.02, name)
    assert rejudge(c, "remove", two, one, v) == WATCH


# -- a worker more only shortens the wait --------------------------------------------------------

SPREAD = [0.9, 1.1, 0.95, 1.05, 1.0, 1.0]   # window rates around their mean, 7 % apart


def spread_record(mean: float, waits: list[float], workers: int) -> Record:
    r = Record()
    for i, (f, w) in enumerate(zip(SPREAD, waits)):
        r.add(m(i, workers, mean * f, w))
    return r


def test_a_gain_the_waiting_shares_cannot_explain_is_refused():
    """cnn-all, round 0 of balancer_demand_noise: two workers measured afresh trained 701/s
    waiting 1.5 % of the step time, three 749/s (+6.8 %) waiting 1.9 %. Three workers kept
    there; but the loop's own work cannot get faster with a worker more, so with the wait no
    shorter the gain is the machine's or noise: refused, and clearly so (its standard error is
    the waiting shares', smaller than the rates')."""
    c = PolicyConfig()
    recs = {TWO: spread_record(701, [0.01, 0.02, 0.015, 0.015, 0.01, 0.02], 2),
            THREE: spread_record(749, [0.02, 0.015, 0.02, 0.025, 0.015, 0.02], 3)}
    v = verdict(c, recs, TWO, THREE, "add", 0.10, name)
    assert not v.ok and v.unexplained and not is_close(v, c.confidence), v
    assert "+6.8%" in v.why and "explains at most -0.4%" in v.why, v.why
    # the same rates with the wait falling from 9 % to 2 %: the shorter wait explains +7.7 %; the rates decide
    recs[TWO] = spread_record(701, [0.08, 0.10, 0.09, 0.09, 0.08, 0.10], 2)
    v = verdict(c, recs, TWO, THREE, "add", 0.10, name)
    assert v.ok and not v.unexplained and "explains" not in v.why, v
    # a loop that waits nearly all its step time does almost no work of its own: its waiting
    # shares tell nothing (their standard error exceeds the rates'), and the rates decide
    recs = {TWO: spread_record(701, [0.995, 0.99, 0.995, 0.99, 0.995, 0.99], 2),
            THREE: spread_record(749, [0.99, 0.995, 0.99, 0.995, 0.99, 0.995], 3)}
    v = verdict(c, recs, TWO, THREE, "add", 0.01, name)
    assert v.ok and not v.unexplained, v


def test_waiting_gain():
    from feedgpu.balancer.verdict import waiting_gain
    a, b = record([400] * 4, 0.30, 1), record([540] * 4, 0.05, 2)
    gain, se = waiting_gain(a, b)
    assert gain == pytest.approx(0.95 / 0.70 - 1) and 0 < se < 0.02
    assert waiting_gain(Record(n=2, rate=1.0, wait=1.0), b) == (math.inf, 0.0)   # nothing trained at a
    # each setting's own spread: waits 10 points apart widen the error
    wide = Record()
    for i, w in enumerate([0.0, 0.1] * 3):
        wide.add(m(i, 2, 540, w))
    assert waiting_gain(a, wide)[1] > 2 * se


def test_a_refused_setting_whose_rate_the_wait_cannot_explain_does_not_set_the_bar():
    """A deeper prefetch measured on a lucky stretch (+16 % with the wait no shorter) is refused;
    its record would set the bar a worker less is judged against (the best setting measured) and
    refuse a worker less that trains within the tolerance of two. It is dropped: one worker,
    2 % slower than two, is kept."""
    cfg = PolicyConfig(max_workers=2, max_prefetch=3)
    rate = {(2, 2): 414.0, (2, 3): 480.0, (1, 2): 405.0, (1, 3): 405.0}
    wait = {(2, 2): 0.04, (2, 3): 0.04, (1, 2): 0.10, (1, 3): 0.10}
    p, key = Policy(cfg), TWO
    for t in range(40):
        d = p.decide(m(t, key[0], rate[key], wait[key], prefetch=key[1], cores=1.0))
        key = (d.workers, d.prefetch)
    exps = p.stats()["experiments"]
    assert [(e["to"], e["kept"]) for e in exps][:2] == [("2w/p3", False), ("1w/p2", True)], exps
    assert "explains at most" in exps[0]["why"] and "2w/p3" not in p.stats()["rates"]
    assert key == ONE


def test_a_kept_worker_less_still_a_close_call_where_the_loop_stalls_has_the_old_count_measured_afresh():
    """cnn-all, round 0 of balancer_paired_cores: one worker kept at -1.1 % against two workers'
    first windows, the loop waiting 14 % of its step time there vs 2 %; two workers trained
    faster once the run warmed up. After ``2 * max_measure_windows`` windows of a close call
    with the loop waiting longer, two workers are measured afresh: here they train 10 % faster,
    and the step is undone. Where two still train as one (the cheaper step was right), it is
    kept again, and not looked at again. (The first windows' confirmation, which would measure
    two workers afresh at once, is off: this is the second look alone.)"""
    cfg = PolicyConfig(max_workers=2, max_prefetch=2, noise_prior=0.07, noise_floor=0.07, confirm_first=False)

    def run(later_two: float):
        p, key, ds, at_two = Policy(cfg), TWO, [], 0
        for t in range(70):
            f = SPREAD[t % len(SPREAD)]
            if key == TWO:
                rate = (600.0 if at_two < 8 else later_two) * f
                at_two += 1
            else:
                rate = 600.0 * f
            d = p.decide(m(t, key[0], rate, 0.02 if key == TWO else 0.14, prefetch=key[1], cores=1.0))
            ds.append(d)
            key = (d.workers, d.prefetch)
        return ds

    ds = run(660.0)
    kept = [i for i, d in enumerate(ds) if d.experiment and d.experiment["kept"]]
    assert kept and ds[kept[0]].workers == 1, [(d.kind, d.workers, d.reason) for d in ds]
    look = [i for i, d in enumerate(ds) if "afresh once more" in d.reason]
    assert look and ds[look[0]].workers == 2, [(d.kind, d.workers, d.reason) for d in ds]
    assert "close call over 12 windows while the loop waits longer for batches there" in ds[look[0]].reason
    undone = [d.experiment for d in ds[look[0]:] if d.experiment]
    assert undone and not undone[0]["kept"] and "measured again after the step" in undone[0]["why"], undone
    assert all(d.workers == 2 for d in ds[look[0]:])
    # two workers no faster afresh: one is kept again, and watched no more
    ds = run(600.0)
    look = [i for i, d in enumerate(ds) if "afresh once more" in d.reason]
    assert len(look) == 1, [(d.kind, d.workers, d.reason) for d in ds]
    again = [d.experiment for d in ds[look[0]:] if d.experiment]
    assert again and again[0]["kept"] and ds[-1].workers == 1, [(d.kind, d.workers, d.reason) for d in ds]


def replay(rates: dict, windows: int, cfg: PolicyConfig | None = None):
    """Drive a policy from two workers / prefetch 2; ``rates[key]`` is an iterator of (rate,
    waiting share) for the windows run at ``key``. Returns the decisions."""
    p, key, ds = Policy(cfg or PolicyConfig(max_workers=2, max_prefetch=2)), TWO, []
    for t in range(windows):
        rate, wait = next(rates[key])
        d = p.decide(m(t, key[0], rate, wait, prefetch=key[1], cores=0.4 * key[0]))
        ds.append(d)
        key = (d.workers, d.prefetch)
    return ds


def cycle(*values):
    while True:
        yield from values


def test_a_cheaper_step_against_the_runs_first_windows_is_confirmed_against_fresh_ones():
    """cnn-all, round 1 of balancer_paired_waiting: two workers trained 680/s and 674/s in the
    run's first windows (it was warming up, ~810/s later), one worker then 716/s and 722/s with
    the loop waiting 20 % of its step time: +6 %, kept on 2 windows each, and the run trained
    one worker 12 % below two to its end. A cheaper step judged against a record that starts
    with the run's first windows is confirmed against two workers measured afresh."""
    warm = iter([(681, 0.05), (680, 0.05), (674, 0.05)])
    two = itertools.chain(warm, cycle((800, 0.05), (830, 0.05), (815, 0.05), (790, 0.05)))
    one = cycle((716, 0.20), (722, 0.20), (700, 0.20), (730, 0.20))
    ds = replay({TWO: two, ONE: one}, 40)
    first = next(d.experiment for d in ds if d.experiment)
    assert first["to"] == "1w/p2" and not first["kept"], first["text"]
    assert "measured again after the step; before it 677/s over 2 windows" in first["why"], first["why"]
    confirm = next(d.reason for d in ds if "afresh" in d.reason)
    assert "against the run's first windows" in confirm, confirm
    assert all(d.workers == 2 for d in ds[-20:]), [(d.kind, d.reason) for d in ds]
    # one worker as fast as two measured afresh: the cheaper step is kept, after the confirmation
    two = itertools.chain(iter([(681, 0.05), (680, 0.05), (674, 0.05)]), cycle((720, 0.02), (712, 0.02)))
    ds = replay({TWO: two, ONE: cycle((716, 0.05), (722, 0.05))}, 40)
    kept = [d.experiment for d in ds if d.experiment and d.experiment["kept"]]
    assert kept and kept[0]["to"] == "1w/p2" and "measured again after the step" in kept[0]["why"], kept
    assert ds[-1].workers == 1


def test_a_cheaper_step_against_the_windows_of_a_drift_is_confirmed_against_fresh_ones():
    """cnn-all, round 7 of balancer_paired_waiting: two windows at two workers read 672/s and
    700/s against a record near 840/s, the records were forgotten with those two windows as the
    new record's first, and one worker (716/s, 684/s, 699/s) was kept as within 3 % of them; it
    trained there to the end. Windows chosen for lying on one side of the old mean set the bar
    low: the step is confirmed against two workers measured afresh."""
    dip = iter([(672, 0.05), (700, 0.05)])
    steady = cycle((840, 0.05), (830, 0.05), (850, 0.05), (836, 0.05))
    t = {"n": 0}

    def two():
        while True:
            t["n"] += 1
            yield next(dip) if 24 <= t["n"] <= 25 else next(steady)

    cfg = PolicyConfig(max_workers=2, max_prefetch=2, recheck_windows=500)
    ds = replay({TWO: two(), ONE: cycle((716, 0.20), (684, 0.20), (699, 0.20))}, 70, cfg)
    forgot = [i for i, d in enumerate(ds) if "records forgotten" in d.reason]
    assert forgot, [(d.kind, d.reason) for d in ds]
    after = [d for d in ds[forgot[0]:] if d.experiment]
    assert after and after[0].experiment["to"] == "1w/p2" and not after[0].experiment["kept"], \
        [(d.kind, d.reason) for d in ds[forgot[0]:]]
    assert any("against the windows of a drift" in d.reason for d in ds[forgot[0]:])
    assert all(d.workers == 2 for d in ds[-10:])


def test_the_first_windows_stay_marked_until_their_record_is_measured_afresh():
    """cnn-all tries a worker more first (the loop waits 5 % at two): refused on its own windows
    (three workers clearly slower), it leaves two workers' record as it was, still starting with
    the run's first windows, so the worker less tried next is confirmed against them as well."""
    two = itertools.chain(iter([(681, 0.05), (680, 0.05), (674, 0.05)]), cycle((800, 0.05), (830, 0.05)))
    rates = {TWO: two, ONE: cycle((716, 0.20), (722, 0.20)), THREE: cycle((560, 0.01), (570, 0.01))}
    ds = replay(rates, 40, PolicyConfig(max_workers=3, max_prefetch=2))
    exps = [d.experiment for d in ds if d.experiment]
    assert [(e["to"], e["kept"]) for e in exps][:2] == [("3w/p2", False), ("1w/p2", False)], exps
    assert "measured again after the step" not in exps[0]["why"], exps[0]       # refused on its windows
    assert "measured again after the step; before it" in exps[1]["why"], exps[1]
    assert any("against the run's first windows" in d.reason for d in ds)
    assert all(d.workers == 2 for d in ds[-10:]), [(d.kind, d.reason) for d in ds]
