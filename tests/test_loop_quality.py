"""benchmarks/loop_quality.py on a small population: it runs the real gate and ranks the rules sanely."""

import importlib.util
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]


def test_loop_quality_small_population(tmp_path):
    out = tmp_path / "lq.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loop_quality.py"), "--campaigns", "60", "--hypotheses", "40",
         "--rho", "0.02", "--in-flight", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: a target missed, which a population this small may do
    doc = json.loads(out.read_text())
    rules = {r["rule"]: r for r in doc["rules"]}
    assert set(rules) == {"paired", "paired-0.025", "sequential", "sequential-v1", "fixed-5v2", "fixed-10", "keep-discard"}
    assert {r["prior"] for r in doc["rules"]} == {"bundled"}
    seq, v1, kd, f10 = (rules[k] for k in ("sequential", "sequential-v1", "keep-discard", "fixed-10"))
    paired = rules["paired"]
    assert (paired["seeds"], seq["seeds"], v1["seeds"], kd["seeds"]) == ("block", "block", "separate", "fresh")
    assert paired["lazy_baseline"] and not seq["lazy_baseline"]
    # a null is promoted by one noisy run far more often than by the gate, and so is a harm
    assert kd["promoted"]["null"] > 0.10 and seq["promoted"]["null"] < 0.04
    assert kd["promoted"]["harm"] > seq["promoted"]["harm"] == 0.0
    # large gains always get through; the gate stops nulls early: under half the runs of a fixed 10
    assert seq["promoted"]["horizontal@3"] > 0.95
    assert f10["challenger_runs_per_null"] == 10.0 and seq["challenger_runs_per_null"] < 5.0
    # the baseline's runs are counted: 10 at the start and 10 per promotion (a mean over campaigns)
    promotions = (seq["baseline_runs_per_hypothesis"] * seq["hypotheses"] - 10) / 10
    assert promotions >= 1
    assert seq["runs_per_hypothesis"] == pytest.approx(seq["challenger_runs_per_hypothesis"]
                                                       + seq["baseline_runs_per_hypothesis"])
    # the campaign banks real improvement, and the gate's measured drift exceeds the true one
    # (promotions are selected on lucky runs): the winner's curse, measured
    assert seq["drift"]["true"] > 1 and seq["drift"]["measured"] > seq["drift"]["true"]
    # the paired rule: the same error control, fewer runs (a lazy baseline, nulls stopped at 1 or 2
    # runs), so more true gain per run than the two-sample gate
    assert paired["promoted"]["null"] < 0.04 and paired["promoted"]["harm"] == 0.0
    assert paired["promoted"]["horizontal@3"] > 0.95
    assert paired["challenger_runs_per_null"] < seq["challenger_runs_per_null"]
    assert paired["baseline_runs_per_hypothesis"] < seq["baseline_runs_per_hypothesis"]
    assert paired["true_gain_per_1000_runs"] > seq["true_gain_per_1000_runs"]
    assert paired["runs_per_hypothesis"] == pytest.approx(paired["challenger_runs_per_hypothesis"]
                                                          + paired["baseline_runs_per_hypothesis"])


def _loop_quality():
    """benchmarks/loop_quality.py as a module (benchmarks/ is no package)."""
    name = "benchmarks_loop_quality"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "loop_quality.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _check_trace(trace, campaigns):
    """Every promotion is on a comparison with the baseline of its moment; a re-base is a promote
    decision against a base that moved, and the same hypothesis is measured again, from its first
    look, against the baseline it was re-based onto."""
    ends = defaultdict(list)
    for e in trace:
        ends[(e["campaign"], e["hypothesis"])].append(e)
        if e["decision"] == "promote":
            assert e["base_generation"] == e["generation"], e
        if e["decision"] == "rebase":
            assert e["base_generation"] < e["generation"], e
    for evs in ends.values():
        for a, b in zip(evs, evs[1:]):
            assert a["decision"] == "rebase", (a, b)  # only a re-base measures a hypothesis again
            assert b["base_generation"] == a["generation"] and b["rebases"] == a["rebases"] + 1, (a, b)
        assert evs[-1]["decision"] != "rebase"
    for c in range(campaigns):  # one promotion per baseline generation, in order
        gens = [e["generation"] for e in trace if e["campaign"] == c and e["decision"] == "promote"]
        assert gens == list(range(len(gens)))
    return sum(e["decision"] == "rebase" for e in trace)


def _in_flight_checks(lq, rule_name, campaigns, hypotheses):
    i = [r.name for r in lq.RULES].index(rule_name)
    rule, sigma, pair = lq.RULES[i], np.full(lq.TASKS, 0.01), np.full(lq.TASKS, 0.8)
    sequential = lq.campaign(rule, 0.02, campaigns, hypotheses, 0, sigma, i, False, pair)
    trace = []
    one = lq.concurrent_campaign(rule, 0.02, campaigns, hypotheses, 0, sigma, i, False, pair, in_flight=1, trace=trace)
    assert one == sequential  # k = 1 is the sequential campaign, number for number
    assert _check_trace(trace, campaigns) == 0 and one["rebases_per_hypothesis"] == 0
    trace = []
    four = lq.concurrent_campaign(rule, 0.02, campaigns, hypotheses, 0, sigma, i, False, pair, in_flight=4,
                                  trace=trace)
    rebases = _check_trace(trace, campaigns)
    assert rebases > 0 and four["rebases_per_hypothesis"] == pytest.approx(rebases / (campaigns * hypotheses))
    assert four["in_flight"] == 4 and 0 < four["rebased_share"] <= four["rebases_per_hypothesis"]
    # every hypothesis decided once; the re-measurements cost runs; the campaign is shorter
    assert sum(e["decision"] != "rebase" for e in trace) == campaigns * hypotheses
    assert sum(e["runs"] for e in trace) == pytest.approx(four["challenger_runs_per_hypothesis"] * campaigns * hypotheses)
    assert four["span_per_hypothesis"] < one["span_per_hypothesis"]
    # the baseline moved by exactly the true effects of the promotions, each against its current baseline
    banked = sum(e["effect"] for e in trace if e["decision"] == "promote") / campaigns
    assert four["drift"]["true"] == pytest.approx(banked)
    return one, four


def test_loop_quality_in_flight():
    """Issue 22: k hypotheses in flight, re-based before a promotion when their base moved."""
    lq = _loop_quality()
    for name in ("sequential", "keep-discard"):
        _in_flight_checks(lq, name, 30, 30)
    # overlapping re-bases bank less than additive ones, on the same draws
    i = [r.name for r in lq.RULES].index("sequential")
    sigma, pair = np.full(lq.TASKS, 0.01), np.full(lq.TASKS, 0.8)
    add = lq.concurrent_campaign(lq.RULES[i], 0.02, 30, 30, 0, sigma, i, False, pair, in_flight=4)
    half = lq.concurrent_campaign(lq.RULES[i], 0.02, 30, 30, 0, sigma, i, False, pair, in_flight=4, overlap=1.0)
    assert half["drift"]["true"] < add["drift"]["true"]


@pytest.mark.slow
def test_loop_quality_in_flight_paired():
    """The same for the default rule, whose lazy baseline is kept per baseline generation (the gate's
    boundary calibrations take most of this test's time)."""
    lq = _loop_quality()
    one, four = _in_flight_checks(lq, "paired", 6, 10)
    assert four["baseline_runs_per_hypothesis"] > 0


def test_peer_rules_fdp():
    """Issue 34: the peers' rules at a threshold grid, and FDP. A threshold of 0 is keep/discard on
    its noise stream, number for number; a huge threshold promotes nothing (FDP undefined, no gain);
    each rule's runs are what it says; a promoted null is a false discovery."""
    lq = _loop_quality()
    sigma, pair = np.full(lq.TASKS, 0.01), np.full(lq.TASKS, 0.8)
    i = [r.name for r in lq.RULES].index("keep-discard")
    kd = lq.campaign(lq.RULES[i], 0.02, 20, 40, 0, sigma, i, False, pair)
    rows = {p.name: lq.peer_campaign(p, 0.02, 20, 40, 0, sigma, i, thresholds=(0.0, 1.0, 1e9)) for p in lq.PEERS}
    zero, one, huge = rows["threshold"]
    same = ("promoted", "promotions", "false_promotions", "fdp", "runs_per_hypothesis", "true_gain_per_1000_runs",
            "drift", "challenger_runs_per_null")
    assert {k: zero[k] for k in same} == {k: kd[k] for k in same} and kd["promotions"] > 0
    assert 0 < one["promotions"] < zero["promotions"] and one["fdp"] < zero["fdp"]  # a noise floor: fewer, truer
    for name, (_, _, none) in rows.items():
        assert none["promotions"] == 0 and none["fdp"] is None and none["true_gain_per_1000_runs"] == 0, name
        assert lq.best_at([none], lq.TARGET_FDP) is none  # nothing promoted counts as FDP 0
    # runs: one per challenger (threshold, senpai), three (median of 3), one or three (rerun)
    assert zero["challenger_runs_per_hypothesis"] == 1 and rows["median3"][0]["challenger_runs_per_hypothesis"] == 3
    assert all(1 < r["challenger_runs_per_hypothesis"] < 3 for r in rows["rerun"])  # 3 where the first looked promising
    s0, s_none = rows["senpai7v1"][0], rows["senpai7v1"][2]
    assert s_none["baseline_runs_per_hypothesis"] * 40 == pytest.approx(7)  # the first champion's seeds alone
    assert s0["baseline_runs_per_hypothesis"] * 40 == pytest.approx(7 + 7 * s0["promotions"] / 20)  # + 7 per promotion
    # FDP: nulls, harms and one-task harms promoted over all promoted; one-task gains are true
    counts = {"null@0": [10, 2], "horizontal@1": [5, 3], "one_task@1": [3, 1], "harm@-1": [4, 1],
              "one_task_harm@-3": [2, 1]}
    B = 2
    row = lq.summary(lq.RULES[i], 0.02, B, 12, "fresh", 0.01, lq.PRIOR, counts, {}, sigma, np.zeros((B, lq.TASKS)),
                     np.ones(B), np.zeros(B), np.zeros(B), {})
    assert (row["promotions"], row["false_promotions"], row["fdp"]) == (8, 4, 0.5)
    # the best variant at FDP ≤ 5 %: the most gain among those at or under it
    grid = [{"rule": "a", "fdp": 0.2, "true_gain_per_1000_runs": 9.0}, {"rule": "b", "fdp": 0.05,
            "true_gain_per_1000_runs": 3.0}, {"rule": "c", "fdp": 0.01, "true_gain_per_1000_runs": 2.0}]
    assert lq.best_at(grid, lq.TARGET_FDP)["rule"] == "b" and lq.best_at(grid[:1], lq.TARGET_FDP) is None


def test_loop_quality_fdp_report(tmp_path):
    """`--fdp`: the peers' grids beside the gate's rules, the default rule's verdicts with its oracle
    gap, and the Pareto picture."""
    out, png = tmp_path / "lq.json", tmp_path / "fdp.png"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loop_quality.py"), "--campaigns", "10", "--hypotheses", "30",
         "--rho", "0.02", "--in-flight", "1", "--rules", "paired", "keep-discard", "--fdp", "--picture", str(png),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr
    doc = json.loads(out.read_text())
    lq = _loop_quality()
    peers = [r for r in doc["rules"] if r["peer"]]
    assert len(peers) == len(lq.PEERS) * len(lq.PEER_THRESHOLDS)
    (v,) = doc["fdp"]["verdicts"]
    assert v["rule"] == "paired" and set(v["best_peer_by_family"]) == {p.name for p in lq.PEERS}
    assert v["oracle"]["designs"] == len(doc["fdp"]["oracle"][0]["designs"]) > 0
    assert "paired: FDP" in done.stdout and "every peer's threshold grid" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lond_rule_alpha(monkeypatch):
    """`paired-lond`: each campaign is one lab's stream; its first comparison is judged at
    lond_alpha(1, 0, 0.05, 0.025), every later one at lond_alpha(i, D) with D its discoveries so far
    (so α grows after a discovery), and that α is the one the gate is run at (`look_path`'s alpha)."""
    from pipeline.gate.online_fdr import lond_alpha

    lq = _loop_quality()
    rule = next(r for r in lq.RULES if r.name == "paired-lond")
    assert rule.online_fdr == "lond" and lq.stream_index(rule) == lq.STREAMS.index("paired")
    assert rule not in lq.default_rules() and len(lq.STREAMS) == 7  # opt-in; the other streams keep their indices
    seen = []
    real = lq.look_path

    def spy(*args, **kw):
        seen.append((kw["alpha"], args[1].shape[0]))
        return real(*args, **kw)

    monkeypatch.setattr(lq, "look_path", spy)
    big = (("horizontal", 1.0, (3.0,)),)  # every hypothesis a 3σ gain: discoveries early
    alphas = []
    row = lq.campaign(rule, 0.02, 6, 4, 0, np.full(lq.TASKS, 0.01), lq.stream_index(rule), False,
                      np.full(lq.TASKS, 0.8), big, alphas=alphas)
    first = alphas[0]
    assert np.all(first["i"] == 1) and np.all(first["discoveries"] == 0)
    assert np.all(first["alpha"] == lond_alpha(1, 0, 0.05, 0.025))
    grew = 0
    for i, (a, b) in enumerate(zip(alphas, alphas[1:]), start=2):
        assert np.all(b["i"] == i) and np.all(b["discoveries"] >= a["discoveries"])
        assert np.array_equal(b["alpha"], [lond_alpha(i, int(d), 0.05, 0.025) for d in b["discoveries"]])
        found = b["discoveries"] > a["discoveries"]
        without = [lond_alpha(i, int(d), 0.05, 0.025) for d in a["discoveries"][found]]
        assert np.all(b["alpha"][found] > without)  # a discovery raises the next comparison's α
        grew += found.sum()
    assert grew > 0 and row["promotions"] > 0 and row["online_fdr"]["fdr"] == 0.05
    # the gate ran once per distinct α of each comparison, on the campaigns that had it
    want = [(float(x), int((s["alpha"] == x).sum())) for s in alphas for x in np.unique(s["alpha"])]
    assert seen == want


def test_fast_paired_boundaries_are_the_gates():
    """The LOND rules' calibration (`fast_paired_boundaries`, patched in while they run) gives the
    product's `paired_boundaries`, bit for bit, at LOND's small α and at the cap."""
    from pipeline.gate.boundaries import paired_boundaries

    lq = _loop_quality()
    for looks, df in (((1, 2), 0), ((1, 2, 5, 10), 40)):
        for alpha in (0.025, 0.0026758, 1.02e-5):
            assert lq.fast_paired_boundaries(looks, 10, alpha, df) == paired_boundaries(looks, 10, alpha, df)
    import pipeline.gate.boundaries as paired_protocol  # the paired protocol reads it from there at each call

    before = paired_protocol.paired_boundaries
    with lq.fast_boundaries():
        assert paired_protocol.paired_boundaries is lq.fast_paired_boundaries
    assert paired_protocol.paired_boundaries is before


def test_confirm_rule_replicates_each_promotion_on_fresh_pairs(monkeypatch):
    """`paired-confirm2` (opt-in): every promotion the gate grants is first replicated on 2 fresh
    pairs per task and kept only where their horizontal mean Δ > 0. With a gate stubbed to grant
    every hypothesis at look 1, a null passes about half the time and a 3σ gain nearly always; the
    old baseline's 2 runs per task on those seeds are paid for each candidate, the challenger's only
    where it is not confirmed (otherwise they are the new champion's first runs)."""
    lq = _loop_quality()
    rule = next(r for r in lq.RULES if r.name == "paired-confirm2")
    plain = next(r for r in lq.RULES if r.name == "paired")
    assert rule.confirm == 2 and rule not in lq.default_rules() and lq.stream_index(rule) == lq.stream_index(plain)

    def grant_all(rule, base, chal, depth, pair_hist, arm_hist, alpha=None):
        b, k, j = base.shape[0], len(rule.looks), base.shape[1]
        return lq.LookPath(looks=tuple(rule.looks), codes=np.full((b, k), lq.CODE[lq.Verdict.improvement]),
                           horizontal_up=np.ones((b, k), bool), task_up=np.ones((b, k, j), bool),
                           horizontal_delta=np.zeros((b, k)), task_delta=np.zeros((b, k, j)),
                           held=np.zeros((b, k), bool))

    monkeypatch.setattr(lq, "judge", grant_all)
    sigma, pair = np.full(lq.TASKS, 0.01), np.full(lq.TASKS, 0.8)
    campaigns, hypotheses = 200, 5
    rows = {}
    for name, prior in (("null", (("null", 1.0, (0.0,)),)), ("gain", (("horizontal", 1.0, (3.0,)),))):
        for r in (plain, rule):
            rows[name, r.name] = lq.campaign(r, 0.02, campaigns, hypotheses, 0, sigma, lq.stream_index(r), False,
                                             pair, prior)
    total = campaigns * hypotheses
    assert rows["null", "paired"]["promotions"] == rows["gain", "paired"]["promotions"] == total
    assert 0.4 < rows["null", "paired-confirm2"]["promotions"] / total < 0.6
    assert rows["gain", "paired-confirm2"]["promotions"] / total > 0.97
    # every candidate cost 2 old-baseline runs per task; a 3σ gain's candidates were nearly all kept
    extra = rows["gain", "paired-confirm2"]["runs_per_hypothesis"] - rows["gain", "paired"]["runs_per_hypothesis"]
    assert 1.9 < extra < 2.2, extra
    # the stricter variant: a one-sided t test at 0.10 on the fresh pairs passes about a tenth of the nulls
    strict = next(r for r in lq.RULES if r.name == "paired-confirm2-t10")
    null = lq.campaign(strict, 0.02, campaigns, hypotheses, 0, sigma, lq.stream_index(strict), False, pair,
                       (("null", 1.0, (0.0,)),))
    gain = lq.campaign(strict, 0.02, campaigns, hypotheses, 0, sigma, lq.stream_index(strict), False, pair,
                       (("horizontal", 1.0, (3.0,)),))
    assert 0.05 < null["promotions"] / total < 0.16 and gain["promotions"] / total > 0.97
    with pytest.raises(ValueError, match="in flight 1 only"):  # not silently the plain rule's numbers
        lq.concurrent_campaign(rule, 0.02, 2, 2, 0, sigma, lq.stream_index(rule), False, pair, in_flight=2)
