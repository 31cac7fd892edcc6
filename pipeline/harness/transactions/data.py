"""Synthetic customers, their event streams and their task labels — deterministic by data seed.

The generative story, kept deliberately simple so a reader can predict what should help where:

* every customer has latent traits (income, risk, life stage, engagement, digital affinity, travel,
  gambling, family, informal cash flow) plus two behavioural latents that only show in *how* events happen
  (`night`: share of late-night activity; `trend`: activity rising or fading over the window);
* four sources emit events whose categories load on different traits: card transactions show
  income/life stage/travel/engagement (and a little risk and family), PIX transfers show informal
  cash flow (nowhere else to be seen), gambling and risk strongly, app events show digital affinity and engagement, bill payments show life
  stage and family;
* tabular bureau-like columns are noisy views of some traits (the "basic" ones are demographic, the
  others come from the credit bureau);
* each task's label is a Bernoulli draw from a logistic function of a task-specific mix of traits and
  behavioural latents, so some sources help many tasks (PIX) and some help one (app → churn).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TRAITS = ["income", "risk", "life_stage", "engagement", "digital", "travel", "gambling", "family", "cashflow",
          "night", "trend"]
T = {name: i for i, name in enumerate(TRAITS)}

SOURCES = ["card", "pix", "app", "bill"]
N_CATEGORIES = {"card": 16, "pix": 8, "app": 10, "bill": 6}
N_AMOUNT_BUCKETS = 4
WINDOW_DAYS = 90.0

# Mean events per customer in the window and the traits that raise the rate.
RATE = {
    "card": (36.0, {"engagement": 0.35, "income": 0.15}),
    "pix": (14.0, {"engagement": 0.2, "gambling": 0.2}),
    "app": (22.0, {"digital": 0.5, "engagement": 0.3}),
    "bill": (6.0, {"life_stage": 0.15}),
}
# Which traits each source's categories reveal, and how strongly.
REVEALS = {
    "card": {"income": 0.8, "life_stage": 0.7, "travel": 0.9, "engagement": 0.5, "risk": 0.45, "family": 0.5,
             "gambling": 0.4},
    "pix": {"cashflow": 1.6, "gambling": 1.3, "risk": 0.8, "family": 0.5},
    "app": {"digital": 1.2, "engagement": 0.9},
    "bill": {"life_stage": 1.0, "family": 1.0, "risk": 0.4},
}

BASIC_TABULAR = ["age", "tenure_months", "declared_income", "region_index"]
BUREAU_TABULAR = ["credit_score", "debt_ratio", "n_products", "dependents", "late_payments_12m", "utilization"]
TABULAR = BASIC_TABULAR + BUREAU_TABULAR
# (trait loadings, noise sd) per tabular column, all standardised afterwards.
TABULAR_SPEC = {
    "age": ({"life_stage": 1.0}, 0.5),
    "tenure_months": ({"engagement": 0.3}, 1.0),
    "declared_income": ({"income": 1.0}, 0.9),
    "region_index": ({}, 1.0),
    "credit_score": ({"risk": -1.0}, 0.8),
    "debt_ratio": ({"risk": 0.7, "gambling": 0.3}, 0.9),
    "n_products": ({"engagement": 0.5, "income": 0.4}, 0.9),
    "dependents": ({"family": 1.0}, 0.8),
    "late_payments_12m": ({"risk": 0.8}, 1.0),
    "utilization": ({"risk": 0.4, "income": -0.3}, 1.0),
}

# The small suite's tasks: weights on latent traits. The full suite adds 16 generated mixes.
SMALL_TASKS: dict[str, dict[str, float]] = {
    "default_90d": {"risk": 1.0, "cashflow": -0.9, "income": -0.5, "gambling": 0.4},
    "churn_60d": {"engagement": -0.8, "trend": -1.3, "digital": -0.6},
    "fraud_alert": {"night": 1.3, "travel": 0.8, "gambling": 0.5},
    "card_upgrade": {"income": 1.2, "engagement": 0.6, "travel": 0.6},
    "investment_uptake": {"income": 0.8, "digital": 0.9, "cashflow": 0.7},
    "personal_loan": {"family": 0.8, "cashflow": -0.6, "life_stage": -0.9, "risk": 0.4},
    "insurance_uptake": {"family": 1.0, "life_stage": 0.9, "income": 0.4},
    "betting_limit": {"gambling": 1.2, "night": 1.2, "cashflow": -0.4},
}
_EXTRA_NAMES = [
    "mortgage_interest", "cashback_optin", "travel_insurance", "overdraft_use", "salary_portability",
    "crypto_uptake", "savings_goal", "card_cancel", "limit_increase_accept", "bnpl_uptake",
    "auto_loan", "pix_scheduled", "premium_account", "collections_entry", "merchant_account", "pension_plan",
]


def _extra_tasks() -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(20240817)
    tasks = {}
    for name in _EXTRA_NAMES:
        picks = rng.choice(len(TRAITS), size=3, replace=False)
        weights = rng.choice([-1, 1], size=3) * rng.uniform(0.5, 1.3, size=3)
        tasks[name] = {TRAITS[int(k)]: round(float(w), 2) for k, w in zip(picks, weights)}
    return tasks


FULL_TASKS = {**SMALL_TASKS, **_extra_tasks()}
SUITES = {"small": list(SMALL_TASKS), "full": list(FULL_TASKS)}
DEFAULT_CUSTOMERS = {"small": 6000, "full": 40000}
# The generator's seed stream is `[data_seed, stream]`: numpy's SeedSequence hashes the whole list, so
# the smoke stream's last word (never DATA_STREAM) gives draws no real data seed ever gives.
DATA_STREAM, SMOKE_STREAM = 7919, 104729
# Customer ids: real ones count up from ID_BASE, a smoke dataset's from SMOKE_ID_BASE (disjoint below it).
ID_BASE, SMOKE_ID_BASE = 100_000, 1_000_000_000
# Label logits are the weighted sum of traits, scaled so the Bayes AUC is high but not perfect.
LABEL_SCALE = 1.6
SPLIT_FRACTIONS = (0.5, 1 / 6)  # train, val; the rest is test


@dataclass
class Dataset:
    """Everything the generator makes. `labels` covers every customer, test included (sealed later)."""

    ids: np.ndarray  # int64 [N]
    split: np.ndarray  # int8 [N]: 0 train, 1 val, 2 test
    tabular: np.ndarray  # float32 [N, F]
    traits: np.ndarray  # float32 [N, K], never published
    events: dict[str, np.ndarray]  # flat arrays sorted by (customer row, day), plus offsets [N+1]
    labels: dict[str, np.ndarray]  # int8 [N] per task


def _trait_matrix(rng: np.random.Generator, n: int) -> np.ndarray:
    k = len(TRAITS)
    cov = np.eye(k)
    for a, b, r in [("income", "risk", -0.3), ("engagement", "digital", 0.3), ("life_stage", "family", 0.4),
                    ("gambling", "risk", 0.3), ("income", "travel", 0.3)]:
        cov[T[a], T[b]] = cov[T[b], T[a]] = r
    return rng.multivariate_normal(np.zeros(k), cov, size=n, method="cholesky")


def _loading(spec: dict[str, float]) -> np.ndarray:
    v = np.zeros(len(TRAITS))
    for name, w in spec.items():
        v[T[name]] = w
    return v


def _source_events(rng: np.random.Generator, source: str, z: np.ndarray) -> dict[str, np.ndarray]:
    n = len(z)
    n_cat = N_CATEGORIES[source]
    base, rate_spec = RATE[source]
    counts = rng.poisson(base * np.exp(z @ _loading(rate_spec)))
    counts = np.minimum(counts, int(base * 6))
    cust = np.repeat(np.arange(n), counts)
    # Category logits: each category loads on the revealed traits with a random sign and weight.
    reveal = np.zeros((len(TRAITS), n_cat))
    for name, strength in REVEALS[source].items():
        reveal[T[name]] = rng.normal(0, 1, n_cat) * strength
    cat_bias = rng.normal(0, 0.7, n_cat)
    logits = z @ reveal + cat_bias  # [N, C]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    cum = np.cumsum(probs, axis=1)
    u = rng.random(len(cust))
    category = np.minimum((u[:, None] > cum[cust]).sum(1), n_cat - 1)
    # Amounts: income raises them, categories shift them.
    log_amount = 0.6 * z[cust, T["income"]] + rng.normal(0, 0.6, n_cat)[category] + rng.normal(0, 0.8, len(cust))
    amount_bucket = np.digitize(log_amount, [-0.8, 0.0, 0.8])
    # Timing: activity rises (trend > 0) or fades (trend < 0) across the window.
    beta = 1.8 * z[cust, T["trend"]]
    r = rng.random(len(cust))
    safe = np.where(np.abs(beta) < 1e-6, 1e-6, beta)
    pos = np.log1p(r * np.expm1(safe)) / safe  # inverse CDF of a density ∝ exp(beta * pos) on [0, 1]
    day = (WINDOW_DAYS * (1.0 - pos)).astype(np.float32)  # days before the reference date
    # Hour of day: the night latent raises the share of 0–5 h events.
    p_night = 1 / (1 + np.exp(-(-1.6 + 1.1 * z[cust, T["night"]])))
    night = rng.random(len(cust)) < p_night
    hour = np.where(night, rng.integers(0, 6, len(cust)), rng.integers(6, 24, len(cust)))
    return {
        "customer": cust.astype(np.int32),
        "source": np.full(len(cust), SOURCES.index(source), dtype=np.int8),
        "category": category.astype(np.int16),
        "amount_bucket": amount_bucket.astype(np.int8),
        "hour": hour.astype(np.int8),
        "day": day,
    }


def generate(suite: str, data_seed: int, customers: int | None = None, smoke: bool = False) -> Dataset:
    """Generate the whole dataset for a suite. Same (suite, data_seed, customers, smoke) → same bytes.

    A smoke dataset (`smoke=True`) is drawn from a stream of its own and has ids of its own: no
    customer, trait or id of it is one of a real dataset's, whatever the seeds and sizes."""
    n = customers or DEFAULT_CUSTOMERS[suite]
    if n > SMOKE_ID_BASE - ID_BASE:
        raise ValueError(f"{n} customers: ids from {ID_BASE} would reach the smoke ids at {SMOKE_ID_BASE}")
    tasks = {name: FULL_TASKS[name] for name in SUITES[suite]}
    rng = np.random.default_rng([data_seed, SMOKE_STREAM if smoke else DATA_STREAM])
    z = _trait_matrix(rng, n)

    parts = [_source_events(rng, source, z) for source in SOURCES]
    events = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    order = np.lexsort((-events["day"], events["customer"]))  # per customer, oldest first
    events = {key: v[order] for key, v in events.items()}
    events["offsets"] = np.searchsorted(events["customer"], np.arange(n + 1)).astype(np.int64)

    cols = []
    for name in TABULAR:
        spec, noise = TABULAR_SPEC[name]
        cols.append(z @ _loading(spec) + rng.normal(0, noise, n))
    tabular = np.stack(cols, 1)
    tabular = ((tabular - tabular.mean(0)) / tabular.std(0)).astype(np.float32)

    labels = {}
    for name, weights in tasks.items():
        w = _loading(weights)
        score = z @ w / np.linalg.norm(w)
        base_rate = 0.15 + 0.25 * rng.random()
        intercept = np.quantile(LABEL_SCALE * score, 1 - base_rate)
        p = 1 / (1 + np.exp(-(LABEL_SCALE * score - intercept)))
        labels[name] = (rng.random(n) < p).astype(np.int8)

    split = np.full(n, 2, dtype=np.int8)
    perm = rng.permutation(n)
    n_train, n_val = int(n * SPLIT_FRACTIONS[0]), int(n * SPLIT_FRACTIONS[1])
    split[perm[:n_train]] = 0
    split[perm[n_train:n_train + n_val]] = 1
    ids = ((SMOKE_ID_BASE if smoke else ID_BASE) + rng.permutation(n)).astype(np.int64)
    return Dataset(ids, split, tabular, z.astype(np.float32), events, labels)
