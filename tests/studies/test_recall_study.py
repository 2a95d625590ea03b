"""The recall study's regimes: orthonormal keys only where they exist (n <= d), and the least-squares
state's own accuracy, which can stay high past D_phi."""
from __future__ import annotations

import numpy as np


def test_recall_points_have_three_regimes_and_orthonormal_keys_read_at_most_d_pairs(monkeypatch, tmp_path):
    import linattn_nb.analysis as analysis
    from linattn_nb.studies import Context, recall

    pts = recall.points(Context(out=tmp_path, profile="tiny", plots=False))
    assert [r for r, _, _ in recall.REGIMES] == list(dict.fromkeys(p["regime"] for p in pts))
    assert {p["regime"] for p in pts if p.get("orthogonal_keys")} == {"orthonormal keys"}
    seen = []

    def fake(fmap, d, n_pairs, **kw):
        seen.append((list(n_pairs), kw.get("orthogonal_keys", False)))
        return {"n_pairs": list(n_pairs)}

    monkeypatch.setattr(analysis, "recall_capacity", fake)
    run = dict(feature_map="elu", num_features=None, map_params={}, d=8, trials=1)
    recall.run(n_pairs=[4, 8, 32], orthogonal_keys=True, **run)
    recall.run(n_pairs=[32, 64], orthogonal_keys=True, **run)
    res = recall.run(n_pairs=[4, 8, 32], **run)
    assert seen == [([4, 8], True), ([8], True), ([4, 8, 32], False)]
    assert res["d_phi"] == 8 and res["estimator"] == ""


def test_least_squares_accuracy_is_exact_up_to_d_phi():
    from linattn_nb.analysis import recall_capacity

    res = recall_capacity("elu", 8, [4, 8, 64], trials=1)
    assert res.optimal_accuracy.shape == (3,)
    np.testing.assert_array_equal(res.optimal_accuracy[:2], 1.0)
    assert 0.0 < res.optimal_accuracy[2] <= 1.0 and res.optimal_mse[2] > 0.8
