"""The rank study's table: an integer where every seed gives the same rank, else mean and 95% interval."""
from __future__ import annotations

import numpy as np
import pytest

from linattn_nb.studies._study import CI_CAPTION, mean_ci, pm, seed_stat


def _records(ranks):
    """One favor+ point per seed at N = 64 with the given attention ranks (semiseparable rank 4)."""
    return [dict(status="ok", params=dict(feature_map="favor+", num_features=8, n=64, d=4, m=8, seed=s),
                 result=dict(d_phi=8, attention_rank=r, semiseparable_rank=4)) for s, r in enumerate(ranks)]


def test_rank_cells_follow_the_seed_interval_convention(tmp_path):
    from linattn_nb.studies import Context, rank

    ctx = Context(out=tmp_path, profile="tiny", plots=False)
    md = rank.render(_records([6, 7, 8]), ctx).markdown
    assert CI_CAPTION in md and "range over the seeds" not in md
    cell = pm(*mean_ci(np.array([6.0, 7.0, 8.0])))
    assert f"| {cell} / 4 |" in md and "±" in cell and "6–8" not in md
    # seeds that agree: the rank itself, no interval
    assert "| 7 / 4 |" in rank.render(_records([7, 7, 7]), ctx).markdown


def test_seed_stat_keeps_the_sign_of_infinite_samples():
    """An infinite per-seed value makes the mean infinite with its own sign (NaN where both signs come);
    the half-width is then undefined.  -inf used to come back as +inf."""
    nan = float("nan")
    for x, want in (([-np.inf, 1.0], -np.inf), ([np.inf, 1.0, np.inf], np.inf), ([np.inf, -np.inf], nan)):
        m, h = seed_stat(x)
        assert (m == want or (np.isnan(m) and np.isnan(want))) and np.isnan(h), x
    assert seed_stat([1.0, 2.0, 3.0])[0] == 2.0 and seed_stat([]) == pytest.approx((nan, nan), nan_ok=True)


def test_points_refuse_a_dim_n_or_m_whose_arrays_exceed_the_limit(monkeypatch, tmp_path):
    """points checked only lower bounds (and drew each random map at d to learn its D_φ): linattn rank
    --dim 100000000 (or --n) failed point by point or ran out of memory.  A point whose largest array
    exceeds config.QUADRATIC_MAX_ELEMENTS is refused, naming the setting, the array and the limit."""
    from linattn_nb import config
    from linattn_nb.studies import Context, rank

    ctx = Context(out=tmp_path, profile="tiny", plots=False)
    monkeypatch.setattr(config, "QUADRATIC_MAX_ELEMENTS", 1000)
    assert rank.points(ctx, maps=["elu"], dim=4, n=[16, 250])  # 250 x 4 <= 1000
    with pytest.raises(ValueError, match=r"rank study: dim = 4, n = 251, .* n x d queries = 251 x 4 array, "
                                         r"more than config\.QUADRATIC_MAX_ELEMENTS = 1000"):
        rank.points(ctx, maps=["elu"], n=[16, 251])
    with pytest.raises(ValueError, match=r"dim = 40, .* D_φ x M state = 40 x 40 "):
        rank.points(ctx, maps=["elu"], dim=40, n=[2])
    with pytest.raises(ValueError, match=r"map favor\+ \(D_φ = 8\).* d x d orthogonal block = 40 x 40 "):
        rank.points(ctx, maps=["favor+"], dim=40, n=[2], value_dim=8)
    with pytest.raises(ValueError, match=r"value_dim = 600, .* n x M values = 16 x 600 "):
        rank.points(ctx, maps=["elu"], value_dim=600, n=[16])
    monkeypatch.undo()
    for kw in ({"dim": 10 ** 8}, {"n": 10 ** 8}, {"m": 10 ** 8}):
        with pytest.raises(ValueError, match="QUADRATIC_MAX_ELEMENTS"):
            rank.points(ctx, **kw)


def test_rank_report_says_1_seed_not_1_seeds(tmp_path):
    from linattn_nb.studies import Context, rank

    res = rank.render(_records([6]), Context(out=tmp_path, profile="tiny", plots=False))
    assert "1 seed (" in res.markdown and "1 seeds" not in res.markdown
    assert "1 seed," in res.summary and "1 seeds" not in res.summary
