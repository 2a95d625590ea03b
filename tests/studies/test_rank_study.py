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
