"""The MQAR recall-frontier study (linattn_nb.studies.mqar): grid, generator, records, resume, figure.

Accuracies are not checked: the tiny profile trains for a few steps, so its numbers say nothing about the
layers.  What is checked is the form of every record and that the sweep and the report behave.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from linattn_nb.studies import Context, get_study, load_results, run_report, sweep
from linattn_nb.studies import mqar

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
POINT_KEYS = {"layer", "head_dim", "kv", "length", "seed", "steps", "vocab", "d_model", "heads", "n_train",
              "n_test", "eval_every", "lr"}
RESULT_KEYS = {"final_accuracy", "best_accuracy", "steps", "seconds", "curve", "parameters", "d_phi", "state",
               "machine", "threads"}


def test_importing_the_studies_needs_no_torch_and_the_study_says_it_needs_it():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import linattn_nb.studies as s\n"
            "st = s.get_study('mqar')\n"
            "print(st.requires())\n"
            "print(len(st.points(s.Context(out='.', profile='tiny'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "needs the optional package 'torch'" in out
    assert int(out.strip().splitlines()[-1]) >= 2


@pytest.mark.parametrize("profile", ["tiny", "quick", "full"])
def test_one_point_per_layer_state_pairs_and_seed(profile, tmp_path):
    pts = get_study("mqar").points(Context(out=tmp_path, profile=profile))
    assert pts and all(set(p) == POINT_KEYS for p in pts)
    keys = [(p["layer"], p["head_dim"], p["kv"], p["seed"]) for p in pts]
    assert len(set(keys)) == len(keys)
    # every (layer, head_dim, kv) is run for the same seeds, at least two
    seeds = {}
    for layer, d, kv, seed in keys:
        seeds.setdefault((layer, d, kv), set()).add(seed)
    assert len({frozenset(s) for s in seeds.values()}) == 1 and len(next(iter(seeds.values()))) >= 2
    for p in pts:
        assert p["layer"] in mqar.LAYERS and p["length"] >= 4 * p["kv"] and p["kv"] <= p["vocab"] // 2 - 1
    assert "softmax" in {p["layer"] for p in pts}


def test_the_whole_grid(tmp_path, monkeypatch):
    pts = mqar.points(Context(out=tmp_path, profile="tiny"), grid="all")
    assert {p["layer"] for p in pts} == set(mqar.LAYERS)
    assert {p["kv"] for p in pts} == {4, 8, 16, 32}
    assert len(pts) == len(mqar.LAYERS) * 4 * 4 * 3
    # at least four state sizes per layer, growing with the head dimension
    for layer in mqar.LAYERS:
        dims = sorted({p["head_dim"] for p in pts if p["layer"] == layer})
        assert len(dims) >= 4
        states = [mqar.state_numbers(layer, d, length=64) for d in dims]
        assert states == sorted(set(states))
    monkeypatch.setenv("LINATTN_NB_MQAR_GRID", "all")
    assert len(mqar.points(Context(out=tmp_path, profile="quick"))) == len(pts)
    monkeypatch.setenv("LINATTN_NB_MQAR_GRID", "bogus")
    with pytest.raises(ValueError, match="grid"):
        mqar.points(Context(out=tmp_path, profile="quick"))


def test_state_sizes_follow_the_maps():
    assert mqar.state_numbers("additive-elu", 16) == 16 * 16
    assert mqar.state_numbers("delta", 16) == 16 * 16
    assert mqar.state_numbers("additive-dpfp", 16) == 32 * 16
    assert mqar.state_numbers("additive-taylor2", 8) == (1 + 8 + 36) * 8
    assert mqar.state_numbers("softmax", 16, length=64) == 64 * 32
    with pytest.raises(ValueError, match="length"):
        mqar.state_numbers("softmax", 16)


def test_generator_stores_every_queried_pair_and_fills_with_other_tokens():
    pytest.importorskip("torch")
    vocab, kv, length = 64, 8, 64
    x, y = mqar.mqar(50, vocab=vocab, kv=kv, length=length, seed=3)
    assert x.shape == y.shape == (50, length)
    for xi, yi in zip(x.numpy(), y.numpy()):
        keys, vals = xi[0:2 * kv:2], xi[1:2 * kv:2]
        assert len(set(keys)) == kv and all(1 <= k < vocab // 2 for k in keys) and all(v >= vocab // 2 for v in vals)
        pos = np.flatnonzero(yi != -100)
        assert len(pos) == kv and set(xi[pos]) == set(keys)
        pairs = dict(zip(keys, vals))
        assert all(pairs[xi[p]] == yi[p] for p in pos)
        filler = np.setdiff1d(np.arange(2 * kv, length), np.concatenate([pos, pos + 1]))
        assert not set(xi[filler]) & (set(keys) | set(vals))
    with pytest.raises(ValueError, match="length"):
        mqar.mqar(2, vocab=vocab, kv=kv, length=4 * kv - 2)
    with pytest.raises(ValueError, match="vocabulary"):
        mqar.mqar(2, vocab=16, kv=8, length=64)


def test_a_bad_grid_in_the_environment_is_refused_as_the_option_is(tmp_path, monkeypatch, capsys):
    """LINATTN_NB_MQAR_GRID=bogus made --out, wrote a report.md holding the traceback and exited 1, where
    --grid bogus exits 2 and writes nothing; now the same (a --grid given wins over the variable)."""
    pytest.importorskip("torch")
    from linattn_nb import cli

    monkeypatch.setenv("LINATTN_NB_MQAR_GRID", "bogus")
    out = tmp_path / "r"
    assert cli.main(["mqar", "--profile", "tiny", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "LINATTN_NB_MQAR_GRID must be 'profile' or 'all'" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_command_takes_the_whole_grid_and_states_its_time(tmp_path, monkeypatch, capsys):
    """`linattn mqar --grid all` hands the report the whole grid's points, the study is as registered
    afterwards, and the option's help states the grid's time."""
    pytest.importorskip("torch")
    import linattn_nb.studies as studies
    from linattn_nb import cli

    monkeypatch.delenv("LINATTN_NB_MQAR_GRID", raising=False)
    seen = []

    def report(out, *, profile, **kw):
        seen.append(len(get_study("mqar").points(Context(out=tmp_path, profile=profile))))
        raise KeyboardInterrupt  # nothing trained: the CLI's own stop

    monkeypatch.setattr(studies, "run_report", report)
    for extra in (["--grid", "all"], []):
        assert cli.main(["mqar", "--profile", "tiny", "--no-progress", "--out", str(tmp_path / "r")] + extra) == 130
    tiny = len(mqar.points(Context(out=tmp_path, profile="tiny")))
    assert seen == [len(mqar.LAYERS) * 4 * 4 * 3, tiny] and tiny < seen[0]
    assert len(get_study("mqar").points(Context(out=tmp_path, profile="tiny"))) == tiny
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["mqar", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--grid {profile,all}" in text and " ".join(mqar.WHOLE_GRID_TIME.split()) in text


def test_tiny_sweep_resumes_without_loss_or_rerun_and_writes_the_figure(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out = tmp_path / "r"
    out.mkdir()
    pts = get_study("mqar").points(Context(out=out, profile="tiny"))
    # a partial run: the first points only, as an interrupted report leaves them
    partial = sweep(mqar.run, pts[:2], out=out / "mqar.jsonl", progress=False)
    assert [r["status"] for r in partial] == ["ok", "ok"]
    res = run_report(out, profile="tiny", studies=["mqar"], resume=True, progress=False, log=lambda line: None)
    assert res.problems == []
    recs = load_results(out / "mqar.jsonl")
    lines = [ln for ln in (out / "mqar.jsonl").read_text().splitlines() if '"type": "result"' in ln
             or '"type":"result"' in ln]
    # nothing lost, nothing run twice: one record per point, the partial run's records kept as they were
    assert len(recs) == len(pts) == len(lines)
    by_key = {r["key"]: r for r in recs}
    for r in partial:
        assert by_key[r["key"]]["finished"] == r["finished"] and by_key[r["key"]]["result"] == r["result"]
    assert sorted(map(str, (r["params"] for r in recs))) == sorted(map(str, pts))
    for r in recs:
        assert r["status"] == "ok" and set(r["params"]) == POINT_KEYS
        res_ = r["result"]
        assert set(res_) == RESULT_KEYS
        assert res_["steps"] == r["params"]["steps"] and res_["seconds"] > 0 and res_["machine"]
        assert 0.0 <= res_["final_accuracy"] <= res_["best_accuracy"] <= 1.0
        assert res_["curve"][-1]["step"] == res_["steps"] and res_["curve"][-1]["acc"] == res_["final_accuracy"]
        assert res_["state"] == mqar.state_numbers(r["params"]["layer"], r["params"]["head_dim"],
                                                   length=r["params"]["length"])
    assert (out / "mqar.png").read_bytes()[:8] == PNG_MAGIC
    text = (out / "report.md").read_text()
    assert "![" in text and "mqar.png" in text and "What it shows" in text
    for verdict_about in ("softmax attention", "delta"):
        assert verdict_about in text


def test_recall_floor_is_the_least_squares_error_of_the_state():
    assert mqar.recall_floor("additive-elu", 8, 8)["optimal_mse"] == 0.0
    assert mqar.recall_floor("additive-elu", 8, 16)["optimal_mse"] == pytest.approx(0.5, abs=1e-9)
    assert mqar.recall_floor("additive-dpfp", 8, 32)["optimal_mse"] == pytest.approx(0.5, abs=1e-9)
    floor = mqar.recall_floor("delta", 8, 32)
    assert floor["optimal_mse"] == pytest.approx(0.75, abs=1e-9)
    assert floor["recall_floor_accuracy"] == pytest.approx(0.25, abs=1e-9)
    assert mqar.recall_floor("softmax", 8, 32) is None
    # one head: the floor from recall_capacity itself, for maps of signed features too (silu_l2, l2)
    for layer in ("delta", "kda", "additive-hedgehog"):
        dphi = mqar.feature_dim(layer, 8)
        assert mqar.recall_floor(layer, 8, 64, heads=1)["optimal_mse"] == pytest.approx(1 - dphi / 64, abs=1e-9)


def _record(layer, d, kv, seed, acc):
    length = mqar.seq_length(kv)
    params = dict(layer=layer, head_dim=d, kv=kv, length=length, seed=seed, steps=600, vocab=mqar.VOCAB,
                  d_model=mqar.D_MODEL, heads=mqar.HEADS, n_train=100, n_test=10, eval_every=100, lr=mqar.LR)
    result = dict(final_accuracy=acc, best_accuracy=acc, steps=600, seconds=1.0,
                  curve=[dict(step=600, loss=1.0, acc=acc, seconds=1.0)], parameters=1,
                  d_phi=mqar.feature_dim(layer, d), state=mqar.state_numbers(layer, d, length=length),
                  machine="cpu", threads=1)
    return dict(type="result", key=f"{layer}{d}{kv}{seed}", params=params, status="ok", result=result)


def test_render_states_each_check_with_its_verdict(tmp_path):
    """Made-up accuracies where every check holds, then where none does: the verdicts follow the numbers."""
    pytest.importorskip("matplotlib")

    def records(good):
        out = []
        for kv in (4, 16):
            for d in (8, 16, 32):
                for seed in range(3):
                    jitter = 0.01 * seed
                    soft = (0.99 if good else 0.5) - jitter
                    add = (1.0 if kv <= d else 0.3) - jitter if good else 0.5 - jitter
                    delta = (1.0 if kv <= 2 * d else 0.6) - jitter if good else 0.5 - jitter
                    out += [_record("softmax", d, kv, seed, soft), _record("additive-elu", d, kv, seed, add),
                            _record("delta", d, kv, seed, delta)]
        return out

    ctx = Context(out=tmp_path, profile="full")
    text = mqar.render(records(True), ctx).markdown
    assert (tmp_path / "mqar.png").read_bytes()[:8] == PNG_MAGIC
    claims = [ln for ln in text.splitlines() if ln.startswith("- ")]
    assert len(claims) == 3 and all("(supported;" in ln for ln in claims), claims
    assert "| 16 | additive, ELU+1 | 8 | 64 |" in text and "| 0.5 |" in text  # the floor at kv = 2 D_φ
    # the delta check counts its points: above only at kv = 16, d = 8 (additive 0.3, delta 1.0)
    assert "above at 1 of 6 shared points, below at none: kv = 16, d = 8:" in claims[2], claims[2]
    text = mqar.render(records(False), ctx).markdown
    claims = [ln for ln in text.splitlines() if ln.startswith("- ")]
    assert len(claims) == 3 and all("(not supported;" in ln for ln in claims), claims


def test_render_names_the_runs_far_below_their_points_best_seed(tmp_path):
    """A seed more than STALL_GAP below the best of its point is named with both accuracies; a spread within
    the gap names none."""
    ctx = Context(out=tmp_path, profile="full", plots=False)
    recs = [_record("delta", 16, 8, seed, acc) for seed, acc in enumerate((0.97, 0.36, 0.95))]
    recs += [_record("additive-elu", 16, 8, seed, acc) for seed, acc in enumerate((0.6, 0.4, 0.5))]
    text = mqar.render(recs, ctx).markdown
    line = next(ln for ln in text.splitlines() if "below the best seed" in ln)
    assert line.startswith("1 of 6 runs ended more than 0.3 below")
    assert "delta, SiLU+L2 at kv = 8, d = 16, seed 1: 0.36 against 0.97" in line
    assert mqar.stalled_runs(mqar._Agg(recs)) == [(8, "delta", 16, 1, 0.36, 0.97)]
    text = mqar.render(recs[3:], ctx).markdown
    assert "below the best seed" not in text


def test_render_draws_one_row_per_group_of_layers_when_many_ran(tmp_path):
    """Every layer of the whole grid: one figure row per group of FIGURE_GROUPS (softmax in each), every
    layer in some row; few layers: one row."""
    pytest.importorskip("matplotlib")
    recs = [_record(layer, d, kv, seed, 0.5 + 0.1 * seed) for layer in mqar.LAYERS for kv in (4, 8)
            for d in (8, 16) for seed in range(2)]
    ctx = Context(out=tmp_path, profile="full")
    shapes = []
    figure = ctx.figure

    def recording(**kw):
        shapes.append((kw.get("nrows", 1), kw.get("ncols", 1)))
        return figure(**kw)

    ctx.figure = recording
    text = mqar.render(recs, ctx).markdown
    assert "One row per group of layers" in text
    assert (tmp_path / "mqar.png").read_bytes()[:8] == PNG_MAGIC
    assert shapes == [(len(mqar.FIGURE_GROUPS), 2)]
    assert {x for _, members in mqar.FIGURE_GROUPS for x in members} | {"softmax"} == set(mqar.LAYERS)
    text = mqar.render([r for r in recs if r["params"]["layer"] in ("delta", "softmax")], ctx).markdown
    assert "One row per group" not in text and shapes[-1] == (1, 2)


def test_the_report_runs_mqar_when_torch_imports_and_says_how_to_get_it_otherwise(monkeypatch):
    """A section of the default report; without torch it is listed as not run, with the install command."""
    from linattn_nb.studies import _builtin  # noqa: F401
    from linattn_nb.studies._study import STUDIES, get_study

    study = get_study("mqar")
    assert study.in_report and study in [s for s in STUDIES if s.in_report]
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    reason = study.requires()
    assert reason is not None and "torch" in reason and "pip install 'linattn_nb[torch]'" in reason


@pytest.mark.parametrize("layer", ["rwkv7", "delta-product", "gated-delta-product"])
def test_dplr_layers_are_in_the_whole_grid_only_and_train(layer, tmp_path):
    pytest.importorskip("torch")
    assert layer in {p["layer"] for p in mqar.points(Context(out=tmp_path, profile="tiny"), grid="all")}
    for profile in ("tiny", "quick", "full"):
        assert layer not in {p["layer"] for p in mqar.points(Context(out=tmp_path, profile=profile))}
    res = mqar.run(layer, 8, kv=2, length=16, seed=0, steps=2, d_model=16, n_train=16, n_test=8, eval_every=1)
    assert np.isfinite([c["loss"] for c in res["curve"]]).all() and res["state"] == 8 * 8


def test_the_training_set_up_checks_its_arguments_before_making_anything():
    """mqar, Model, accuracy and train checked almost nothing: kv=0 made examples with no query, then
    accuracy divided by zero; kv=-1 an IndexError; kv=True or 2.5 NumPy's TypeErrors; power_a=nan sorted
    NaNs; train(steps=0) an IndexError (curve[-1]); eval_every=0 a ZeroDivisionError; batch=0 torch's."""
    torch = pytest.importorskip("torch")
    for kw, exc, match in [(dict(kv=0), ValueError, "kv must be >= 1"),
                           (dict(kv=-1), ValueError, "kv must be >= 1"),
                           (dict(kv=True), TypeError, "kv must be an integer"),
                           (dict(kv=2.5), TypeError, "kv must be an integer"),
                           (dict(n=-1), ValueError, "n must be >= 0"),
                           (dict(vocab=80.0), TypeError, "vocab must be an integer"),
                           (dict(length=True), TypeError, "length must be an integer"),
                           (dict(power_a=0), ValueError, "power_a must be finite and > 0"),
                           (dict(power_a=float("nan")), ValueError, "power_a must be finite and > 0"),
                           (dict(power_a="1"), TypeError, "power_a must be a positive real number")]:
        args = dict(dict(n=2, vocab=80, kv=4, length=64), **kw)
        with pytest.raises(exc, match=match):
            mqar.mqar(args.pop("n"), **args)
    x, y = mqar.mqar(2, vocab=80, kv=4, length=64, power_a=1e4, seed=0)  # a steep law: the last slots
    assert sorted((y[0] != -100).nonzero().ravel().tolist()) == [56, 58, 60, 62]
    for kw, match in [(dict(d=0), "d must be >= 1"), (dict(heads=0), "heads must be >= 1"),
                      (dict(layers=0), "layers must be >= 1")]:
        with pytest.raises(ValueError, match=match):
            mqar.Model(80, **kw)
    with pytest.raises(TypeError, match="vocab must be an integer"):
        mqar.Model(True)
    data = (*mqar.mqar(8, vocab=80, kv=4, length=64, seed=[0, 1]),
            *mqar.mqar(4, vocab=80, kv=4, length=64, seed=[0, 2]))
    model = mqar.Model(80, d=16, heads=1, layers=1, attention="softmax", head_dim=8)
    with pytest.raises(ValueError, match="y has no query position"):
        mqar.accuracy(model, data[2], torch.full_like(data[3], -100))
    with pytest.raises(ValueError, match="batch must be >= 1"):
        mqar.accuracy(model, data[2], data[3], batch=0)
    with pytest.raises(ValueError, match="one shape"):
        mqar.accuracy(model, data[2], data[3][:2])
    attn = dict(attention="softmax", head_dim=8)
    small = dict(vocab=80, data=data, d=16, heads=1, layers=1, batch=4)
    for kw, exc, match in [(dict(steps=0), ValueError, "steps must be >= 1"),
                           (dict(steps=-1), ValueError, "steps must be >= 1"),
                           (dict(steps=2, eval_every=0), ValueError, "eval_every must be >= 1"),
                           (dict(steps=2, batch=0), ValueError, "batch must be >= 1"),
                           (dict(steps=2.0), TypeError, "steps must be an integer"),
                           (dict(steps=2, lr=0.0), ValueError, "lr must be finite and > 0"),
                           (dict(steps=2, warmup=-1), ValueError, "warmup must be >= 0"),
                           (dict(steps=2, weight_decay=float("inf")), ValueError, "weight_decay must be finite"),
                           (dict(steps=2, threads=0), ValueError, "threads must be >= 1"),
                           (dict(steps=2, vocab=40), ValueError, r"outside \[0, vocab\) = \[0, 40\)"),
                           (dict(steps=2, data=data[:3]), TypeError, "data must be a tuple"),
                           (dict(steps=2, data=(data[0][:0], data[1][:0], *data[2:])), ValueError,
                            "y_train has no query position")]:
        with pytest.raises(exc, match=match):
            mqar.train(attn, **dict(small, **kw))
    res = mqar.train(attn, steps=1, **small)
    assert res["steps"] == 1 and [c["step"] for c in res["curve"]] == [1]
