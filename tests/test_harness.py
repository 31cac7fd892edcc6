"""The transactions harness: deterministic data, sealed test labels, and an exact scorer."""

import hashlib
import itertools
from pathlib import Path

import numpy as np
import pytest

from pipeline.harness import get_harness
from pipeline.harness.base import MethodFailure, auc, read_predictions
from pipeline.harness.transactions import data as gen

pytestmark = pytest.mark.unit

N = 600


@pytest.fixture(scope="module")
def harness():
    return get_harness("transactions")


@pytest.fixture(scope="module")
def prepared(harness, tmp_path_factory):
    return harness.prepare(tmp_path_factory.mktemp("state"), "small", 0, customers=N)


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        h.update(f.name.encode())
        if f.suffix == ".npz":
            with np.load(f) as z:
                for k in sorted(z.files):
                    h.update(k.encode() + z[k].tobytes())
        else:
            h.update(f.read_bytes())
    return h.hexdigest()


def test_same_seed_same_data_other_seed_other_data(harness, prepared, tmp_path):
    again = harness.prepare(tmp_path / "a", "small", 0, customers=N)
    other = harness.prepare(tmp_path / "b", "small", 1, customers=N)
    assert digest(again.public) == digest(prepared.public)
    assert digest(other.public) != digest(prepared.public)
    assert np.array_equal(harness.test_labels(again, "churn_60d"), harness.test_labels(prepared, "churn_60d"))


def test_prepare_is_idempotent(harness, prepared):
    stamp = (prepared.public / "meta.json").stat().st_mtime_ns
    assert harness.prepare(prepared.public.parent.parent, "small", 0, customers=N) == prepared
    assert (prepared.public / "meta.json").stat().st_mtime_ns == stamp


def test_suites_and_sources():
    assert len(gen.SUITES["small"]) == 8 and len(gen.SUITES["full"]) == 24
    assert gen.SUITES["full"][:8] == gen.SUITES["small"]
    assert len(set(gen.SUITES["full"])) == 24
    assert set(gen.SOURCES) >= {"card", "pix", "app", "bill"}


def test_public_data_shape(prepared):
    with np.load(prepared.public / "customers.npz") as c, np.load(prepared.public / "events.npz") as e:
        assert len(c["id"]) == N and c["tabular"].shape == (N, len(gen.TABULAR))
        assert set(np.unique(c["split"])) == {0, 1, 2}
        assert set(np.unique(e["source"])) == set(range(len(gen.SOURCES)))
        assert np.all(np.diff(e["customer"]) >= 0)
        assert e["offsets"][-1] == len(e["customer"])


def test_test_labels_are_not_public(harness, prepared):
    with np.load(prepared.public / "customers.npz") as c, np.load(prepared.public / "labels.npz") as pub:
        test = c["split"] == 2
        for task in gen.SUITES["small"]:
            assert np.all(pub[task][test] == -1)
            assert set(np.unique(pub[task][~test])) == {0, 1}
            sealed = harness.test_labels(prepared, task)
            assert len(sealed) == test.sum() and 0 < sealed.mean() < 1
        assert np.array_equal(harness.test_ids(prepared), c["id"][test])


def test_sealed_folder_is_unreachable_from_stage_paths(prepared):
    """A stage gets {data} = prepared.public (and its own {out}); nothing below it reaches the seal."""
    sealed = prepared.sealed.resolve()
    assert not sealed.is_relative_to(prepared.public.resolve())
    for f in prepared.public.rglob("*"):
        assert not f.is_symlink()
        assert not f.resolve().is_relative_to(sealed)
    assert oct(sealed.parent.stat().st_mode & 0o777) == "0o700"
    # and no public array equals a sealed label vector
    with np.load(prepared.sealed / "test_labels.npz") as s:
        secrets = {k: s[k] for k in s.files if k != "ids"}
    for f in prepared.public.glob("*.npz"):
        with np.load(f) as z:
            for key, a in itertools.product(z.files, secrets):
                assert not (z[key].shape == secrets[a].shape and np.array_equal(z[key], secrets[a])), (f, key)


def test_labels_depend_on_traits_differently(harness, tmp_path):
    """Tasks are different mixes: their labels are far from identical."""
    ds = gen.generate("small", 0, customers=2000)
    ys = np.stack([ds.labels[t] for t in gen.SUITES["small"]])
    corr = np.corrcoef(ys)
    assert np.max(np.abs(corr[np.triu_indices(8, 1)])) < 0.6


@pytest.mark.parametrize(
    "labels,scores,expected",
    [
        ([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8], 0.75),  # the classic sklearn example
        ([0, 1], [0.2, 0.9], 1.0),
        ([0, 1], [0.9, 0.2], 0.0),
        ([0, 0, 1], [0.5, 0.5, 0.5], 0.5),  # ties count one half
        ([1, 0, 1, 0, 1], [3, 1, 2, 2, 5], (1 + 1 + 0.5 + 1 + 1 + 1) / 6),  # pairs (pos, neg) by hand
    ],
)
def test_auc_by_hand(labels, scores, expected):
    assert auc(np.array(labels), np.array(scores, dtype=float)) == pytest.approx(expected)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_score_perfect_and_reversed(harness, prepared, tmp_path):
    ids = harness.test_ids(prepared)
    y = harness.test_labels(prepared, "churn_60d")
    good = write(tmp_path / "p.csv", "id,score\n" + "".join(f"{i},{v}\n" for i, v in zip(ids, y)))
    bad = write(tmp_path / "q.csv", "id,score\n" + "".join(f"{i},{-v}\n" for i, v in zip(ids[::-1], y[::-1])))
    assert harness.score(prepared, "churn_60d", good) == 1.0
    assert harness.score(prepared, "churn_60d", bad) == 0.0


@pytest.mark.parametrize(
    "body,message",
    [
        (None, "not found"),
        ("", "header"),
        ("idx,score\n", "header"),
        ("id,score\n1,2,3\n", "2 columns"),
        ("id,score\nx,0.1\n", "integer id"),
        ("id,score\n{first},nan\n", "not finite"),
        ("id,score\n{first},0.1\n{first},0.2\n", "duplicate"),
        ("id,score\n{first},0.1\n", "missing"),
    ],
)
def test_malformed_predictions_are_rejected(harness, prepared, tmp_path, body, message):
    path = tmp_path / "predictions.csv"
    if body is not None:
        path.write_text(body.format(first=int(harness.test_ids(prepared)[0])))
    with pytest.raises(MethodFailure, match=message):
        read_predictions(path, harness.test_ids(prepared))


def test_extra_ids_are_rejected(harness, prepared, tmp_path):
    ids = harness.test_ids(prepared)
    body = "id,score\n" + "".join(f"{i},0.5\n" for i in ids) + "1,0.5\n"
    with pytest.raises(MethodFailure, match=f"more rows than the {len(ids)} test ids"):
        read_predictions(write(tmp_path / "p.csv", body), ids)


def test_a_huge_predictions_file_is_refused_before_it_is_read(harness, prepared, tmp_path):
    """Branch output: the driver never holds more than the test set's worth of it (issue 20)."""
    ids = harness.test_ids(prepared)
    path = tmp_path / "p.csv"
    with path.open("w") as fh:
        fh.write("id,score\n" + "".join(f"{i},0.5\n" for i in ids))
        fh.truncate((len(ids) + 1) * 256 + 1)  # sparse: its size counts, not its blocks
    with pytest.raises(MethodFailure, match=f"more than {(len(ids) + 1) * 256} for {len(ids)} test ids"):
        read_predictions(path, ids)
