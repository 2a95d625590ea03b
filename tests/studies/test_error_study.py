"""The approximation-error study's render (linattn_nb.studies.error) on made-up records: no kernels run."""
from __future__ import annotations

from pathlib import Path

import pytest

from linattn_nb.studies import Context, error


def _records(grid):
    """ok records of favor+ at each (m, N) of ``grid`` and elu at each N, two seeds, one regime."""
    res = {f: 0.1 for f in error.FIELDS} | {"d_phi": 8, "is_positive": True, "entropy_softmax": 1.0}
    recs = []
    ns = sorted({n for _, n in grid})
    for seed in (0, 1):
        cells = [("favor+", m, n) for m, n in grid] + [("elu", None, n) for n in ns]
        for name, m, n in cells:
            params = dict(feature_map=name, d=4, qk_scale=1.0, seed=seed, num_features=m, n=n, causal=False)
            recs.append({"params": params, "status": "ok", "result": dict(res, output_rel_error=0.1 + 0.01 * seed)})
    return recs


@pytest.mark.parametrize("grid, text", [
    ({(16, 4), (16, 8), (8, 8), (32, 8)}, "random maps use m = 16 features in the N sweep and m ∈ {8, 16, 32}"),
    # every m at every N (e.g. records of a grid expanded by linattn_nb._overrides.apply_overrides)
    ({(m, n) for m in (8, 16, 32) for n in (4, 8)},
     "random maps use m ∈ {8, 16, 32} features in the N sweep and m ∈ {8, 16, 32}"),
])
def test_regime_text_names_the_m_of_the_n_sweep_records(grid, text):
    md = error.render(_records(grid), Context(out=Path("."), profile="tiny", plots=False)).markdown
    assert text in md, md.split("\n")[0]
