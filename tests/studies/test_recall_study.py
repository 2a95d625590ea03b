"""The recall study's regimes: orthonormal keys only where they exist (n <= d), and the least-squares
state's own accuracy, which can stay high past D_phi."""
from __future__ import annotations

import numpy as np


def test_recall_points_have_four_regimes_and_orthonormal_keys_read_at_most_d_pairs(monkeypatch, tmp_path):
    import linattn_nb.analysis as analysis
    from linattn_nb.studies import Context, recall

    pts = recall.points(Context(out=tmp_path, profile="tiny", plots=False))
    assert [r[0] for r in recall.REGIMES] == list(dict.fromkeys(p["regime"] for p in pts))
    assert {p["regime"] for p in pts if p.get("orthogonal_keys")} == {"orthonormal keys"}
    # only the fixed-state regime has values of a fixed width (d); the others are one-hot (M = n)
    assert {p["regime"]: p.get("value_dim") for p in pts}["fixed state"] == pts[0]["d"]
    assert {p["regime"] for p in pts if "value_dim" in p} == {"fixed state"}
    seen = []

    def fake(fmap, d, n_pairs, **kw):
        seen.append((list(n_pairs), kw.get("orthogonal_keys", False), kw.get("value_dim")))
        return {"n_pairs": list(n_pairs)}

    monkeypatch.setattr(analysis, "recall_capacity", fake)
    run = dict(feature_map="elu", num_features=None, map_params={}, d=8, trials=1)
    recall.run(n_pairs=[4, 8, 32], orthogonal_keys=True, **run)
    recall.run(n_pairs=[32, 64], orthogonal_keys=True, **run)
    res = recall.run(n_pairs=[4, 8, 32], **run)
    recall.run(n_pairs=[4, 8, 32], value_dim=8, **run)
    assert seen == [([4, 8], True, None), ([8], True, None), ([4, 8, 32], False, None), ([4, 8, 32], False, 8)]
    assert res["d_phi"] == 8 and res["estimator"] == ""


def test_least_squares_accuracy_is_exact_up_to_d_phi():
    from linattn_nb.analysis import recall_capacity

    res = recall_capacity("elu", 8, [4, 8, 64], trials=1)
    assert res.optimal_accuracy.shape == (3,)
    np.testing.assert_array_equal(res.optimal_accuracy[:2], 1.0)
    assert 0.0 < res.optimal_accuracy[2] <= 1.0 and res.optimal_mse[2] > 0.8


def test_fixed_width_values_make_the_least_squares_state_fall_just_past_d_phi():
    """With Gaussian values of a fixed width the state is D_phi x M whatever n is: the best state of that size
    reads every key right while n <= D_phi and falls once n passes it (the regime where capacity binds);
    with one-hot values (M = n) it still reads most keys right far past D_phi."""
    from linattn_nb.analysis import recall_capacity

    n = [8, 16, 64]
    fixed = recall_capacity("elu", 16, n, value_dim=16, key_scale=0.5, trials=2)
    np.testing.assert_array_equal(fixed.optimal_accuracy[:2], 1.0)
    assert fixed.optimal_accuracy[2] < 0.5
    onehot = recall_capacity("elu", 16, n, key_scale=0.5, trials=2)
    assert onehot.optimal_accuracy[2] >= 0.9


def test_a_map_of_signed_features_reads_unnormalised_and_is_marked_in_the_table(tmp_path):
    """l2's features are signed: a key's normaliser phi(k) . z can be <= eps, and recall_capacity refuses the
    normalised read-out there.  The study reads such maps unnormalised (phi(k)^T S) and says so in its tables
    instead of recording the point as failed; a map of non-negative features keeps the normalised read-out."""
    from linattn_nb.studies import Context, recall

    run = dict(num_features=None, map_params={}, d=4, n_pairs=[2, 4, 16], trials=1, seed=0, key_scale=1.0)
    signed = recall.run(feature_map="l2", **run)
    positive = recall.run(feature_map="elu", **run)
    assert signed["readout"] == "unnormalised" and signed["normalize"] is False
    assert positive["readout"] == "normalised" and positive["normalize"] is True
    records = [{"params": dict(run, feature_map=name, regime="variance"), "result": res, "status": "ok"}
               for name, res in (("l2", signed), ("elu", positive))]
    md = recall.render(records, Context(out=tmp_path, profile="tiny", plots=False)).markdown
    rows = [line for line in md.splitlines() if line.startswith("| l2") or line.startswith("| elu")]
    assert sorted(line.split(" | ")[0] for line in rows) == ["| elu", f"| l2{recall.UNNORMALISED}"]


def test_points_refuse_a_dim_n_or_m_whose_arrays_exceed_the_limit(monkeypatch, tmp_path):
    """points checked only lower bounds: linattn recall --dim 100000000 (or --n) failed point by point or
    ran out of memory.  A point whose largest array exceeds config.QUADRATIC_MAX_ELEMENTS is refused by
    points, naming the setting, the array and the limit, before any array is made."""
    import pytest

    from linattn_nb import config
    from linattn_nb.studies import Context, recall

    ctx = Context(out=tmp_path, profile="tiny", plots=False)
    monkeypatch.setattr(config, "QUADRATIC_MAX_ELEMENTS", 1000)
    assert recall.points(ctx, maps=["elu"], dim=16, n=[8, 31])  # 31 x 31 <= 1000
    with pytest.raises(ValueError, match=r"recall study: dim = 4, n = 32, .* n x n one-hot values = 32 x 32 "
                                         r"array, .*QUADRATIC_MAX_ELEMENTS = 1000"):
        recall.points(ctx, maps=["elu"], n=[8, 32])
    with pytest.raises(ValueError, match=r"dim = 40, .* map elu .* D_φ x M state = 40 x 40 "):
        recall.points(ctx, maps=["elu"], dim=40)  # the fixed-state regime: M = d
    with pytest.raises(ValueError, match=r"map taylor2 \(D_φ = 153\): .* n x D_φ features = 16 x 153 "):
        recall.points(ctx, maps=["taylor2"], dim=16)
    with pytest.raises(ValueError, match=r"map favor\+ \(m=200\) .* m x d random projection = 200 x 16 "):
        recall.points(ctx, maps=["favor+"], m=200, dim=16, n=[2])
    monkeypatch.undo()
    for kw in ({"dim": 10 ** 8}, {"n": 10 ** 8}, {"m": 10 ** 8}):
        with pytest.raises(ValueError, match="QUADRATIC_MAX_ELEMENTS"):
            recall.points(ctx, **kw)
