"""The offline policy's search order and memory, on the real template's config and search space."""

import tomllib
from pathlib import Path

import pytest

from agent.policy import Context

from agent.policy_offline import OfflinePolicy, config_edit, config_values

pytestmark = pytest.mark.integration

TEMPLATE = Path(__file__).resolve().parent.parent / "pipeline" / "templates" / "transactions"
SPACE = tomllib.loads((TEMPLATE / "research.toml").read_text())["search_space"]
CONFIG = (TEMPLATE / "config.toml").read_text()


def ctx(config: str, tried=()) -> Context:
    return Context("t", "", "auc", ["a", "b"], ["config.toml"], "base", {"config.toml": config},
                   search_space=dict(SPACE), tried_states=list(tried))


def test_round_robin_over_keys_then_pairs_never_repeating():
    c, seen = ctx(CONFIG), []
    for _ in range(12):
        p = OfflinePolicy().propose(c)
        seen.append(tuple(sorted((k, repr(v)) for k, v in p.change.items())))
        c.tried_states.append(p.change)
    assert len(set(seen)) == len(seen)
    base = config_values(CONFIG, list(SPACE))
    firsts = [[k for k in SPACE if dict(s)[k] != repr(base[k])] for s in seen[:4]]
    assert firsts == [[k] for k in SPACE]  # one key at a time, each key in turn


def test_within_a_key_the_farthest_value_comes_first():
    from agent.policy_offline import coarse_to_fine

    assert coarse_to_fine([3e-4, 1e-3, 3e-3], 3e-4) == [3e-3, 1e-3]
    assert coarse_to_fine([3e-4, 1e-3, 3e-3], 1e-3) == [3e-4, 3e-3]  # equally far: list order
    assert coarse_to_fine([4, 8, 16], 16) == [4, 8]
    assert coarse_to_fine([1, 2], 5) == [1, 2]  # the current value is not listed: as listed
    p = OfflinePolicy().propose(ctx(CONFIG))
    assert p.change["finetune.lr"] == 3e-3 and p.title == "Set finetune.lr = 0.003"


def test_cheaper_keys_first_by_the_stages_their_change_reruns(lab):
    from agent.graph import search_key_costs
    from pipeline.lab import load_lab

    costs = search_key_costs(load_lab(lab))
    # [data] keys the pretraining cache (and so fine-tuning); [finetune] only fine-tuning
    assert costs == {"finetune.lr": 1, "finetune.lora_rank": 1, "data.sources": 2, "finetune.tabular": 1}
    c, keys = ctx(CONFIG), []
    c.key_costs = costs
    base = config_values(CONFIG, list(SPACE))
    for _ in range(4):
        p = OfflinePolicy().propose(c)
        keys += [k for k in SPACE if p.change[k] != base[k]]
        c.tried_states.append(p.change)
    assert keys == ["finetune.lr", "finetune.lora_rank", "finetune.tabular", "data.sources"]


def test_an_old_baseline_configuration_is_not_proposed_again():
    promoted = CONFIG.replace(config_edit(CONFIG, "finetune.lr", 1e-3).search, config_edit(CONFIG, "finetune.lr", 1e-3).replace)
    old_state = config_values(CONFIG, list(SPACE))
    p = OfflinePolicy().propose(ctx(promoted, [old_state]))
    assert p.change["finetune.lr"] != 3e-4
    assert p.change != old_state


def test_after_promotions_the_values_a_baseline_moved_away_from_come_last():
    def with_(text, key, value):
        e = config_edit(text, key, value)
        return text.replace(e.search, e.replace)

    v0 = config_values(CONFIG, list(SPACE))
    v1_text = with_(CONFIG, "finetune.lr", 3e-3)
    v2_text = with_(v1_text, "finetune.lora_rank", 16)
    c = ctx(v2_text, [v0, config_values(v1_text, list(SPACE))])
    c.baseline_states = list(c.tried_states)
    c.key_costs = {"finetune.lr": 1, "finetune.lora_rank": 1, "data.sources": 2, "finetune.tabular": 1}
    current, changed = config_values(v2_text, list(SPACE)), []
    while (p := OfflinePolicy().propose(c)) is not None:
        changed.append(sorted((k, repr(v)) for k, v in p.change.items() if v != current[k]))
        c.tried_states.append(p.change)
    back = [("finetune.lr", repr(3e-4))]  # v0's lr, untried with rank 16
    assert [("finetune.lora_rank", "4")] not in changed  # that is v1 itself: measured
    assert changed[0] == [("finetune.tabular", "'all'")]  # not back to lr 3e-4
    assert all(len(x) == 1 for x in changed[:5]) and back not in changed[:5]
    assert back in changed and changed.index(back) > changed.index([("finetune.lr", repr(1e-3))])  # later, not never


def test_config_edit_keeps_comments_and_other_sections():
    e = config_edit(CONFIG, "finetune.lr", 0.003)
    new = CONFIG.replace(e.search, e.replace)
    data = tomllib.loads(new)
    assert data["finetune"]["lr"] == 0.003 and data["pretrain"]["lr"] == 1e-3
    assert "# LoRA adapters" in new


def test_exhaustion_is_per_baseline(lab):
    """An exhausted search stops the loop only around the baseline it was exhausted at."""
    from agent.loop import Loop, LoopOptions
    from agent.records import Hypothesis
    from pipeline.lab import load_lab

    loop = Loop(load_lab(lab), LoopOptions(offline=True))
    try:
        head = loop.svc.workspace.baseline_head()
        old = loop.records.add(Hypothesis(title="(search space exhausted)", status="done", decision="reject",
                                          reject_kind="exhausted", origin="offline", base_commit="0" * 40))
        fresh = loop.next_hypothesis()
        assert fresh is not None and fresh.id != old.id
        loop.records.update(fresh.id, status="done", decision="reject", reject_kind="exhausted", base_commit=head)
        assert loop.next_hypothesis() is None
    finally:
        loop.close()
