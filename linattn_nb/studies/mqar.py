"""Study: trained MQAR accuracy against state size, per update rule and feature map (the recall frontier).

The design, grids and measured cost: docs/mqar.md.  torch (an optional extra) is imported inside the
functions only.
"""
from __future__ import annotations

import functools
import math
import os
import time

import numpy as np

from .._tune import cpu_model
from ._study import (CI_CAPTION, Rendered, Study, fmt, markdown_table, mean_ci, pm, register_study,
                     requires_modules, split_failed)
from ._claims import NOT_APPLICABLE, NOT_SUPPORTED, ONE_SEED, SUPPORTED, Claim

__all__ = ["mqar", "Model", "Block", "SoftmaxAttention", "accuracy", "train", "LAYERS", "state_numbers",
           "points", "run", "render"]

#: The layers compared: key -> (label, LinearAttention keywords; None for softmax attention).
#: Additive rule with four maps; the rules that forget or write with beta with the map their papers use.
LAYERS = {  # not a rule: the study's layer keys (the rule is the rule= keyword)
    "additive-elu": ("additive, ELU+1", dict(feature_map="elu")),
    "additive-dpfp": ("additive, DPFP (ν = 1)", dict(feature_map="dpfp")),
    "additive-taylor2": ("additive, Taylor-2", dict(feature_map="taylor2")),
    "additive-hedgehog": ("additive, Hedgehog (learned)", dict(feature_map="hedgehog", learn_feature_map=True)),
    "decay": ("decay per token, ELU+1", dict(feature_map="elu", rule="decay", decay="token")),
    "gate": ("gate (GLA), ELU+1", dict(feature_map="elu", rule="gate", decay="gate")),
    "delta": ("delta, SiLU+L2", dict(feature_map="silu_l2", rule="delta")),
    "gated-delta": ("gated delta, SiLU+L2", dict(feature_map="silu_l2", rule="gated_delta", decay="token")),
    "kda": ("KDA (gate per feature, delta), L2", dict(feature_map="l2", rule="kda")),
    "rwkv7": ("RWKV-7 (gate per feature, unit removal key), L2", dict(feature_map="l2", rule="rwkv7")),
    "delta-product": ("DeltaProduct (n_h = 2), SiLU+L2", dict(feature_map="silu_l2", rule="delta_product", n_h=2)),
    "gated-delta-product": ("gated DeltaProduct (n_h = 2), SiLU+L2",
                            dict(feature_map="silu_l2", rule="gated_delta_product", n_h=2)),
    "softmax": ("softmax attention", None),
}
#: Rows of the figure when more layers ran than one panel shows clearly (:data:`FIGURE_ROW_MAX`): the
#: additive rule's maps, the rules that forget (beside additive ELU+1, their baseline), the rules that
#: write with beta; softmax attention is drawn in every row for reference.
FIGURE_GROUPS = (
    ("additive, by map", ("additive-elu", "additive-dpfp", "additive-taylor2", "additive-hedgehog")),
    ("decay and gating", ("additive-elu", "decay", "gate")),
    ("delta family", ("delta", "gated-delta", "kda", "rwkv7", "delta-product", "gated-delta-product")),
)
FIGURE_ROW_MAX = 6
#: Head dimensions d (= value dimension M) per layer key: the state sizes of the sweep.  Taylor-2's
#: D_φ = 1 + d + d(d+1)/2 grows as d², so it takes smaller heads to overlap the others' states.
HEAD_DIMS = {"additive-taylor2": (4, 8, 16, 32)}
DEFAULT_HEAD_DIMS = (8, 16, 32, 64)
#: Model width, heads, layers, vocabulary (80 holds 32 pairs and leaves filler tokens), convolution
#: width and learning rate of every run; why these values: docs/mqar.md.
D_MODEL, HEADS, LAYERS_N, VOCAB, CONV, LR = 64, 1, 2, 80, 4, 1e-2
#: The whole grid's cost, for ``linattn mqar --grid all``'s help and docs/mqar.md: from its points timed
#: by benchmarks/mqar_grid_time.py on a local Dask cluster of 2 single-threaded workers (2-vCPU AMD EPYC).
WHOLE_GRID_TIME = ("624 runs of 600 steps: about 12.7 h of runs, so 6.4 h on 2 worker processes "
                   "(--workers 2) or on a Dask cluster of 2 single-threaded workers, about 12.7/N h on N "
                   "(measured on a 2-vCPU AMD EPYC; docs/mqar.md)")
#: Accuracy threshold of the frontier table.
ACCURACY = 0.9
#: A run whose final accuracy is more than this below the best seed of its point is named in the report as
#: a run whose training stalled (MQAR training sometimes plateaus for one seed of a setting the others
#: solve): a wide interval or a dip along the state axis is then the optimiser's, not the layer's.
STALL_GAP = 0.3


def _torch():
    import torch

    return torch


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------
def mqar(n, *, vocab, kv, length, power_a=0.01, seed=0):
    """Multi-query associative recall examples (Zoology, Arora et al. 2023).

    The first ``2 kv`` tokens are the key-value pairs; each key is queried once later, at a gap
    drawn from Zoology's power law ``p ∝ a i^(a-1)``, followed by its value (docs/mqar.md).

    Parameters
    ----------
    n : int
        Number of examples.
    vocab, kv, length : int
        Vocabulary size, key-value pairs, sequence length (``kv <= vocab/2 - 1``, ``length >= 4 kv``).
    power_a : float, default 0.01
        Exponent ``a`` of the power law (finite, > 0).
    seed : int or sequence of int
        For :func:`numpy.random.default_rng`.

    Returns
    -------
    x : torch.Tensor, shape (n, length), int64
        Input tokens.
    y : torch.Tensor, shape (n, length), int64
        The value that follows at each query position, -100 (ignored) elsewhere.

    Raises
    ------
    TypeError
        ``n``, ``vocab``, ``kv`` or ``length`` not an integer (a bool is not one), ``power_a`` not a real
        number.
    ValueError
        ``n < 0``, ``kv < 1``, ``vocab < 4``, ``length < 1``, ``power_a`` not finite and > 0 (the checks
        of :func:`linattn_nb.analysis.mqar`); ``kv`` pairs that do not fit the vocabulary or leave no room
        for a query per key.
    """
    from ..analysis import _common as C

    n = C.check_int("n", n, 0)
    vocab = C.check_int("vocab", vocab, 4)
    kv = C.check_int("kv", kv, 1)
    length = C.check_int("length", length, 1)
    power_a = C.check_positive_float("power_a", power_a)
    torch = _torch()
    if kv > vocab // 2 - 1 or 2 * kv >= vocab:
        raise ValueError(f"mqar: {kv} pairs do not fit a vocabulary of {vocab} (needs kv <= vocab/2 - 1)")
    ctx = 2 * kv
    space = (length - ctx) // 2
    if space < kv:
        raise ValueError(f"mqar: length {length} leaves room for {space} queries after {kv} pairs; "
                         f"needs length >= {4 * kv}")
    rng = np.random.default_rng(seed)
    keys = np.argsort(rng.random((n, vocab // 2 - 1)), axis=1)[:, :kv] + 1
    vals = np.argsort(rng.random((n, vocab // 2)), axis=1)[:, :kv] + vocab // 2
    idx = np.arange(1, space + 1)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        logp = np.log(power_a * idx ** (power_a - 1))
    if not np.isfinite(logp).all():  # a's power over- or underflows: the law's logs, shifted to <= 0 for a > 1
        with np.errstate(over="ignore"):
            logp = (power_a - 1) * (np.log(idx) - math.log(space))
    gaps = np.argsort(-(logp + rng.gumbel(size=(n, space))), axis=1)[:, :kv]
    used = np.zeros((n, vocab), bool)  # filler: tokens that are no key or value here
    np.put_along_axis(used, keys, True, 1)
    np.put_along_axis(used, vals, True, 1)
    allowed = np.argsort(used, axis=1, kind="stable")[:, : vocab - 2 * kv]
    seq = np.take_along_axis(allowed, rng.integers(0, vocab - 2 * kv, (n, length + 1)), 1)
    seq[:, 0:ctx:2], seq[:, 1:ctx:2] = keys, vals
    order = np.argsort(rng.random((n, kv)), axis=1)  # the keys in a random query order
    qk, qv = np.take_along_axis(keys, order, 1), np.take_along_axis(vals, order, 1)
    pos = ctx + 2 * gaps
    np.put_along_axis(seq, pos, qk, 1)
    np.put_along_axis(seq, pos + 1, qv, 1)
    labels = np.full((n, length), -100)
    np.put_along_axis(labels, pos, qv, 1)
    return torch.from_numpy(seq[:, :-1].copy()), torch.from_numpy(labels)


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _modules():
    """The model's classes, built on first use (torch is imported here, not at module import)."""
    torch = _torch()
    from torch import nn

    class _SoftmaxAttention(nn.Module):
        """Causal softmax attention with the same projections and convolution as ``LinearAttention``."""

        def __init__(self, d_model, num_heads, *, head_dim=None, value_dim=None, conv_size=None):
            super().__init__()
            head_dim = head_dim or d_model // num_heads
            value_dim = value_dim or head_dim
            self.num_heads, self.head_dim, self.value_dim, self.conv_size = num_heads, head_dim, value_dim, conv_size
            H = num_heads
            self.q_proj = nn.Linear(d_model, H * head_dim, bias=False)
            self.k_proj = nn.Linear(d_model, H * head_dim, bias=False)
            self.v_proj = nn.Linear(d_model, H * value_dim, bias=False)
            self.out_proj = nn.Linear(H * value_dim, d_model, bias=False)
            if conv_size is not None:
                ch = H * (2 * head_dim + value_dim)
                self.conv = nn.Conv1d(ch, ch, conv_size, groups=ch, padding=conv_size - 1)

        def forward(self, x):
            B, N, _ = x.shape
            H, D, M = self.num_heads, self.head_dim, self.value_dim
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if self.conv_size is not None:
                qkv = self.conv(torch.cat([q, k, v], dim=-1).transpose(1, 2))[..., :N].transpose(1, 2)
                q, k, v = qkv.split([H * D, H * D, H * M], dim=-1)
            q, k, v = (t.reshape(B, N, H, -1).transpose(1, 2) for t in (q, k, v))
            o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out_proj(o.transpose(1, 2).reshape(B, N, H * M))

    class _Block(nn.Module):
        """Pre-LN block: [attention] then a GELU MLP, each with a residual connection."""

        def __init__(self, d, heads, *, attention=None, conv_size=CONV, head_dim=None, **attn):
            super().__init__()
            from ..torch import LinearAttention

            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            if attention == "softmax":
                self.attn = _SoftmaxAttention(d, heads, head_dim=head_dim, conv_size=conv_size)
            else:
                self.attn = LinearAttention(d, heads, head_dim=head_dim, conv_size=conv_size, **attn)
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class _Model(nn.Module):
        """Embedding, ``layers`` blocks, LayerNorm and a linear head over the vocabulary."""

        def __init__(self, vocab, d=64, heads=2, layers=2, **attn):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(_Block(d, heads, **attn) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln(h))

    return dict(SoftmaxAttention=_SoftmaxAttention, Block=_Block, Model=_Model)


def Model(vocab, d=64, heads=2, layers=2, **attn):
    """The MQAR model: embedding, ``layers`` pre-LN blocks, LayerNorm, linear head (a ``torch.nn.Module``).

    Each block is ``x + attn(LN(x))`` then ``x + MLP(LN(x))``; ``attn`` is
    :class:`linattn_nb.torch.LinearAttention` with the keywords ``attn``, or, with
    ``attention="softmax"``, causal softmax attention with the same projections (docs/mqar.md).

    Parameters
    ----------
    vocab : int
    d : int, default 64
        Model width.
    heads : int, default 2
    layers : int, default 2
    **attn
        ``attention="softmax"``, ``conv_size``, ``head_dim`` and the
        ``LinearAttention`` keywords.

    Raises
    ------
    TypeError
        ``vocab``, ``d``, ``heads`` or ``layers`` not an integer.
    ValueError
        One of them < 1.
    """
    _check_model(vocab, d, heads, layers)
    return _modules()["Model"](vocab, d, heads, layers, **attn)


def _check_model(vocab, d, heads, layers) -> tuple:
    from ..analysis import _common as C

    return tuple(C.check_int(name, x, 1) for name, x in (("vocab", vocab), ("d", d), ("heads", heads),
                                                         ("layers", layers)))


def Block(d, heads, **attn):
    """One block of :func:`Model` (a ``torch.nn.Module``)."""
    return _modules()["Block"](d, heads, **attn)


def SoftmaxAttention(d_model, num_heads, **kw):
    """Causal softmax attention with ``LinearAttention``'s projections and convolution (a ``torch.nn.Module``)."""
    return _modules()["SoftmaxAttention"](d_model, num_heads, **kw)


def accuracy(model, x, y, batch=256):
    """Recall accuracy: the fraction of query positions (``y != -100``) whose argmax is the label.

    Parameters
    ----------
    model : torch.nn.Module
        A :func:`Model`.
    x, y : torch.Tensor, shape (n, length)
        Inputs and labels from :func:`mqar`.
    batch : int, default 256
        Examples per forward pass (>= 1).

    Returns
    -------
    float

    Raises
    ------
    TypeError
        ``batch`` not an integer.
    ValueError
        ``batch < 1``; ``x`` and ``y`` of different shapes; ``y`` with no query position (every label
        -100, e.g. no example): no accuracy to report.
    """
    from ..analysis import _common as C

    batch = C.check_int("batch", batch, 1)
    _check_examples("x", x, "y", y)
    torch = _torch()
    model.eval()
    hits = total = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            pred = model(x[i:i + batch]).argmax(-1)
            mask = y[i:i + batch] != -100
            hits += (pred[mask] == y[i:i + batch][mask]).sum().item()
            total += mask.sum().item()
    model.train()
    return hits / total


def _check_examples(xname, x, yname, y) -> None:
    """``x``, ``y`` of one shape (n, length) and at least one query position (a label other than -100)."""
    shape_x, shape_y = tuple(getattr(x, "shape", ())), tuple(getattr(y, "shape", ()))
    if len(shape_x) != 2 or shape_x != shape_y:
        raise ValueError(f"{xname} and {yname} must be tensors of one shape (n, length), got shapes "
                         f"{shape_x} and {shape_y}")
    if not bool((y != -100).any()):
        raise ValueError(f"{yname} has no query position (every label is -100, or no example): no accuracy "
                         "to measure")


def _check_weight_decay(x) -> float:
    import numbers

    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"weight_decay must be a real number >= 0, got {type(x).__name__}")
    if not (0 <= float(x) < math.inf):
        raise ValueError(f"weight_decay must be finite and >= 0, got {x}")
    return float(x)


def train(attn, *, steps, vocab, data, d=64, heads=2, layers=2, batch=64, seed=0, eval_every=50, lr=3e-3,
          warmup=100, weight_decay=0.1, threads=1):
    """Train :func:`Model` on MQAR data; evaluate every ``eval_every`` steps and after the last.

    AdamW, linear warm-up over ``min(warmup, max(steps // 10, 1))`` steps then cosine decay to 0;
    batches drawn with replacement from the training set (docs/mqar.md).

    Parameters
    ----------
    attn : dict
        The attention layer's keywords (see :func:`Model`).
    steps : int
        Training steps (>= 1: the final accuracy is measured after the last step).
    vocab : int
    data : tuple
        ``(x_train, y_train, x_test, y_test)`` from :func:`mqar`.
    d, heads, layers : int
        The model's width, heads and blocks.
    batch : int, default 64
        Examples per step (>= 1).
    seed : int, default 0
        Seeds the initial weights and the order of the batches.
    eval_every : int, default 50
        Steps between evaluations (>= 1); the last step is always evaluated.
    lr, warmup, weight_decay : float, int, float
        Learning rate (> 0), warm-up steps (>= 0), weight decay (>= 0).
    threads : int or None, default 1
        ``torch.set_num_threads`` for the run (None leaves it; docs/threads.md).

    Returns
    -------
    dict
        ``final_accuracy``, ``best_accuracy`` (of the evaluations), ``steps``, ``seconds``,
        ``curve`` (per evaluation: ``step``, ``loss``, ``acc``, ``seconds``), ``parameters``.

    Raises
    ------
    TypeError
        An integer argument not an integer (a bool is not one), ``lr`` or ``weight_decay`` not a real
        number, ``data`` not a tuple of four.
    ValueError
        ``steps``, ``batch``, ``eval_every``, ``threads``, ``vocab``, ``d``, ``heads`` or ``layers`` < 1;
        ``seed`` or ``warmup`` < 0; ``lr`` not finite and > 0; ``weight_decay`` not finite and >= 0; no
        training example, a test set with no query position, or tokens or labels outside ``[0, vocab)``.
    """
    from ..analysis import _common as C

    steps = C.check_int("steps", steps, 1)
    batch = C.check_int("batch", batch, 1)
    seed = C.check_int("seed", seed, 0)
    eval_every = C.check_int("eval_every", eval_every, 1)
    warmup = C.check_int("warmup", warmup, 0)
    lr = C.check_positive_float("lr", lr)
    weight_decay = _check_weight_decay(weight_decay)
    if threads is not None:
        threads = C.check_int("threads", threads, 1)
    vocab = _check_model(vocab, d, heads, layers)[0]
    if not isinstance(data, (tuple, list)) or len(data) != 4:
        raise TypeError("data must be a tuple (x_train, y_train, x_test, y_test) from mqar")
    x_train, y_train, x_test, y_test = data
    _check_examples("x_train", x_train, "y_train", y_train)
    _check_examples("x_test", x_test, "y_test", y_test)
    for name, t, low in (("x_train", x_train, 0), ("x_test", x_test, 0), ("y_train", y_train, -100),
                         ("y_test", y_test, -100)):
        bad = (t < 0) & (t != low) | (t >= vocab)
        if bool(bad.any()):
            raise ValueError(f"{name} holds tokens outside [0, vocab) = [0, {vocab}) (labels may be -100), "
                             f"e.g. {int(t[bad][0])}: data made for another vocabulary?")
    torch = _torch()
    F = torch.nn.functional
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = Model(vocab, d=d, heads=heads, layers=layers, **attn)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    warm = min(warmup, max(steps // 10, 1))

    def schedule(s):
        if s < warm:
            return (s + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (s - warm) / max(steps - warm, 1)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    curve, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(x_train), (batch,), generator=gen)
        logits = model(x_train[idx])
        loss = F.cross_entropy(logits.reshape(-1, vocab), y_train[idx].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            curve.append(dict(step=step, loss=float(loss.item()), acc=accuracy(model, x_test, y_test),
                              seconds=time.perf_counter() - t0))
    return dict(final_accuracy=curve[-1]["acc"], best_accuracy=max(c["acc"] for c in curve), steps=steps,
                seconds=time.perf_counter() - t0, curve=curve,
                parameters=int(sum(p.numel() for p in model.parameters())))


# ---------------------------------------------------------------------------
# the study
# ---------------------------------------------------------------------------
def feature_dim(layer: str, head_dim: int) -> int | None:
    """D_φ of a layer's map at this head dimension (None for softmax attention)."""
    attn = LAYERS[layer][1]
    if attn is None:
        return None
    from .. import feature_maps as fm

    return int(fm.get(attn["feature_map"]).output_dim(head_dim))


def state_numbers(layer: str, head_dim: int, *, heads: int = HEADS, length: int | None = None) -> int:
    """Numbers in one layer's state at the end of a sequence: ``heads · D_φ · M`` (M = ``head_dim``).

    The normaliser ``z`` (D_φ numbers per head) is not counted.  For softmax
    attention, the KV cache of ``length`` tokens: ``heads · length · (d + M)``.
    """
    dphi = feature_dim(layer, head_dim)
    if dphi is None:
        if length is None:
            raise ValueError("state_numbers: softmax attention's KV cache needs the sequence length")
        return heads * length * 2 * head_dim
    return heads * dphi * head_dim


def seq_length(kv: int) -> int:
    """The sequence length for ``kv`` pairs: ``max(64, 4 kv)`` (room for the pairs and one query per key)."""
    return max(64, 4 * kv)


#: The grid of each profile: (layers, head-dimension indices into the layer's list, kv pairs, seeds, steps);
#: ``grid="all"`` (``linattn mqar --grid all``, or LINATTN_NB_MQAR_GRID=all) gives the whole grid.
def _profile(ctx, grid=None):
    grid = grid or os.environ.get("LINATTN_NB_MQAR_GRID", "profile")
    if grid == "all":
        return dict(layers=tuple(LAYERS), dims=(0, 1, 2, 3), kv=(4, 8, 16, 32), seeds=3, steps=600,
                    n_train=20_000, n_test=512, eval_every=100)
    if grid != "profile":
        raise ValueError(f"mqar study: grid must be 'profile' or 'all', got {grid!r}")
    return ctx.pick(
        tiny=dict(layers=("additive-elu", "delta", "softmax"), dims=(0,), kv=(4,), seeds=2, steps=3,
                  n_train=256, n_test=64, eval_every=2),
        quick=dict(layers=("additive-elu", "delta", "softmax"), dims=(0, 1), kv=(8,), seeds=2, steps=30,
                   n_train=2_000, n_test=128, eval_every=30),
        full=dict(layers=("additive-elu", "delta", "softmax"), dims=(0, 2), kv=(4, 16), seeds=3, steps=600,
                  n_train=20_000, n_test=256, eval_every=100),
    )


def points(ctx, *, grid=None) -> list[dict]:
    """One point per (layer, head dimension, kv pairs, seed).

    Parameters
    ----------
    ctx : Context
    grid : {"profile", "all"}, optional
        ``"all"``: the whole grid of docs/mqar.md, whatever the profile; default: the
        environment variable ``LINATTN_NB_MQAR_GRID``, else ``"profile"``.
    """
    p = _profile(ctx, grid)
    out = []
    for kv in p["kv"]:
        for layer in p["layers"]:
            dims = HEAD_DIMS.get(layer, DEFAULT_HEAD_DIMS)
            for i in p["dims"]:
                for seed in range(p["seeds"]):
                    out.append(dict(layer=layer, head_dim=int(dims[i]), kv=kv, length=seq_length(kv), seed=seed,
                                    steps=p["steps"], vocab=VOCAB, d_model=D_MODEL, heads=HEADS, n_train=p["n_train"],
                                    n_test=p["n_test"], eval_every=p["eval_every"], lr=LR))
    return out


def run(layer, head_dim, kv, length, seed, steps, vocab=VOCAB, d_model=D_MODEL, heads=HEADS, n_train=10_000,
        n_test=256, eval_every=50, lr=LR) -> dict:
    """Train one model; return its accuracies, steps, wall time, state size and the machine."""
    attn = LAYERS[layer][1]
    attn = dict(attention="softmax") if attn is None else dict(attn)
    attn["head_dim"] = head_dim
    data = (*mqar(n_train, vocab=vocab, kv=kv, length=length, seed=[seed, 1]),
            *mqar(n_test, vocab=vocab, kv=kv, length=length, seed=[seed, 2]))
    res = train(attn, steps=steps, vocab=vocab, data=data, d=d_model, heads=heads, layers=LAYERS_N, seed=seed,
                eval_every=eval_every, lr=lr)
    dphi = feature_dim(layer, head_dim)
    res.update(d_phi=dphi, state=state_numbers(layer, head_dim, heads=heads, length=length), machine=cpu_model(),
               threads=1)
    return res


# ---------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def recall_floor(layer: str, head_dim: int, kv: int, *, heads: int = HEADS, seed: int = 0) -> dict | None:
    """The least-squares recall floor of a state like this layer's, for ``kv`` pairs (None for softmax).

    Returns ``optimal_mse`` (:func:`linattn_nb.analysis.recall_capacity`) and
    ``recall_floor_accuracy = 1 − optimal_mse``; an error floor, not an accuracy bound (docs/mqar.md).
    """
    attn = LAYERS[layer][1]
    if attn is None:
        return None
    from .. import feature_maps as fm
    from ..analysis import recall_capacity

    dphi = feature_dim(layer, head_dim)
    if heads * dphi >= kv:
        mse = 0.0
    else:
        fmap = fm.get(attn["feature_map"])
        # only the least-squares floor is read: signed maps (whose normaliser may fall to the floor, which
        # recall_capacity refuses) take the unnormalised read-out
        res = recall_capacity(fmap, head_dim, [kv], trials=2, seed=seed,
                              normalize=None if fmap.is_positive else False)
        mse = float(np.asarray(res.optimal_mse, dtype=float)[0]) if heads == 1 else max(0.0, 1 - heads * dphi / kv)
    return dict(optimal_mse=mse, recall_floor_accuracy=1.0 - mse)


class _Agg:
    """ok records grouped: {(kv, layer): {head_dim: [results over seeds]}}."""

    def __init__(self, ok):
        self.by: dict = {}
        self.params: dict = {}
        self.seeds_of: dict = {}  # {(kv, layer, head_dim): [seed of each result in self.by's list]}
        for r in ok:
            p = r["params"]
            self.by.setdefault((p["kv"], p["layer"]), {}).setdefault(p["head_dim"], []).append(r["result"])
            self.params[(p["kv"], p["layer"], p["head_dim"])] = p
            self.seeds_of.setdefault((p["kv"], p["layer"], p["head_dim"]), []).append(p["seed"])
        self.kvs = sorted({k[0] for k in self.by})
        order = list(LAYERS)
        self.layers = sorted({k[1] for k in self.by}, key=order.index)
        self.seeds = sorted({r["params"]["seed"] for r in ok})

    def series(self, kv, layer, field="final_accuracy"):
        """(head dims, states, means, half-widths, seeds per point), ordered by state."""
        cell = self.by.get((kv, layer), {})
        dims = sorted(cell, key=lambda h: cell[h][0]["state"])
        states = np.asarray([cell[h][0]["state"] for h in dims], dtype=float)
        stats = [mean_ci(np.asarray([r[field] for r in cell[h]], dtype=float)) for h in dims]
        means = np.asarray([float(s[0]) for s in stats])
        halves = np.asarray([float(s[1]) for s in stats])
        return dims, states, means, halves, [len(cell[h]) for h in dims]


def stalled_runs(agg, gap=STALL_GAP) -> list:
    """``(kv, layer, head_dim, seed, final accuracy, best seed's)`` of every run more than ``gap`` below the
    best seed of its point (points with two or more seeds), in grid order."""
    out = []
    order = list(LAYERS)
    for (kv, layer), cell in sorted(agg.by.items(), key=lambda kl: (kl[0][0], order.index(kl[0][1]))):
        for dim in sorted(cell):
            accs = [r["final_accuracy"] for r in cell[dim]]
            if len(accs) < 2:
                continue
            best = max(accs)
            out += [(kv, layer, dim, seed, a, best) for seed, a in zip(agg.seeds_of[(kv, layer, dim)], accs)
                    if a < best - gap]
    return out


def findings(agg) -> list:
    """The three checks, each a :class:`Claim` computed from the aggregated accuracies and their intervals (not
    applicable where a point it reads has one seed, which gives no interval)."""
    out = []
    # 1. softmax solves MQAR at every size
    rule = f"mean accuracy − half-width ≥ {ACCURACY} at every head dimension and kv pairs run"
    if "softmax" in agg.layers:
        worst, single = None, []
        for kv in agg.kvs:
            dims, states, m, h, _ = agg.series(kv, "softmax")
            for j in range(len(dims)):
                if math.isnan(h[j]):
                    single.append(f"kv = {kv}, d = {dims[j]}")
                    continue
                if worst is None or m[j] - h[j] < worst[0] - worst[1]:
                    worst = (m[j], h[j], kv, dims[j])
        if single:
            out.append(Claim(NOT_APPLICABLE, f"softmax attention solves MQAR at every size: not tested, {ONE_SEED} "
                                             f"at {'; '.join(single)} (run two or more seeds)", rule))
        elif worst is None:
            out.append(Claim(NOT_APPLICABLE, "softmax attention: no runs", rule))
        elif worst[0] - worst[1] >= ACCURACY:
            out.append(Claim(SUPPORTED, f"softmax attention solves MQAR at every size run: the lowest accuracy is "
                                        f"{pm(worst[0], worst[1])} (kv = {worst[2]}, d = {worst[3]})", rule))
        else:
            out.append(Claim(NOT_SUPPORTED, f"softmax attention solves MQAR at every size: not supported, at kv = "
                                            f"{worst[2]}, d = {worst[3]} its accuracy is {pm(worst[0], worst[1])}",
                             rule))
    else:
        out.append(Claim(NOT_APPLICABLE, "softmax attention was not run", rule))
    # 2. additive accuracy falls once kv exceeds its state, and a larger state moves that point
    add = next((lay for lay in ("additive-elu", "additive-dpfp", "additive-hedgehog", "additive-taylor2")
                if lay in agg.layers), None)
    rule2 = ("at the smallest state, accuracy at the largest kv is below that at the smallest kv (intervals "
             "disjoint), and at the largest kv the largest state beats the smallest (intervals disjoint)")
    if add is None or len(agg.kvs) < 2:
        out.append(Claim(NOT_APPLICABLE, "additive rule: needs runs at two or more kv pairs "
                                         f"(kv run: {agg.kvs})", rule2))
    else:
        lo_kv, hi_kv = agg.kvs[0], agg.kvs[-1]
        d_lo, s_lo, m_lo, h_lo, _ = agg.series(lo_kv, add)
        d_hi, s_hi, m_hi, h_hi, _ = agg.series(hi_kv, add)
        if not len(d_lo) or not len(d_hi) or len(d_hi) < 2:
            out.append(Claim(NOT_APPLICABLE, f"{LAYERS[add][0]}: needs two state sizes at kv = {hi_kv}", rule2))
        elif any(math.isnan(x) for x in (h_lo[0], h_hi[0], h_hi[-1])):
            out.append(Claim(NOT_APPLICABLE, f"{LAYERS[add][0]}: {ONE_SEED} at the smallest or the largest state, so "
                                             f"neither a fall nor a gain is tested (accuracy {pm(m_lo[0], h_lo[0])} "
                                             f"at kv = {lo_kv}, {pm(m_hi[0], h_hi[0])} and {pm(m_hi[-1], h_hi[-1])} "
                                             f"at kv = {hi_kv}; run two or more seeds)", rule2))
        else:
            falls = m_hi[0] + h_hi[0] < m_lo[0] - h_lo[0]
            moves = m_hi[-1] - h_hi[-1] > m_hi[0] + h_hi[0]
            dphi0 = agg.by[(hi_kv, add)][d_hi[0]][0]["d_phi"]
            text = (f"{LAYERS[add][0]}: at the smallest state ({int(s_hi[0])} numbers, D_φ = {dphi0}) accuracy "
                    f"is {pm(m_lo[0], h_lo[0])} at kv = {lo_kv} and {pm(m_hi[0], h_hi[0])} at kv = {hi_kv} "
                    f"({'falls' if falls else 'no fall shown'}); at kv = {hi_kv} the largest state "
                    f"({int(s_hi[-1])}) reaches {pm(m_hi[-1], h_hi[-1])} "
                    f"({'a larger state moves the point' if moves else 'no gain shown'})")
            out.append(Claim(SUPPORTED if falls and moves else NOT_SUPPORTED, text, rule2))
    # 3. delta holds more pairs than additive at the same state
    rule3 = ("at some kv and head dimension where both ran with the same D_φ·M, delta's interval lies above the "
             "additive rule's (ELU+1: D_φ = d for both maps), and nowhere below")
    if "delta" in agg.layers and "additive-elu" in agg.layers:  # not a rule: layer keys of LAYERS
        wins, losses, shared, single = [], [], 0, 0
        for kv in agg.kvs:
            dd, sd, md, hd, _ = agg.series(kv, "delta")
            da, sa, ma, ha, _ = agg.series(kv, "additive-elu")
            for j, dim in enumerate(dd):
                if dim in da:
                    shared += 1
                    i = da.index(dim)
                    cell = (kv, dim, pm(md[j], hd[j]), pm(ma[i], ha[i]))
                    if math.isnan(hd[j]) or math.isnan(ha[i]):
                        single += 1
                    elif md[j] - hd[j] > ma[i] + ha[i]:
                        wins.append(cell)
                    elif md[j] + hd[j] < ma[i] - ha[i]:
                        losses.append(cell)
        def _cells(cs):
            more = f"; and {len(cs) - 4} more" if len(cs) > 4 else ""
            return "; ".join(f"kv = {kv}, d = {dim}: {a} against {b}" for kv, dim, a, b in cs[:4]) + more
        untested = f" ({single} of them not tested: {ONE_SEED})" if single else ""
        if shared and single == shared:
            out.append(Claim(NOT_APPLICABLE, f"delta holds more pairs than additive at the same state: not tested, "
                                             f"{ONE_SEED} at any of the {shared} shared points (run two or more "
                                             "seeds)", rule3))
        elif wins and not losses:
            out.append(Claim(SUPPORTED, f"delta holds more pairs than additive (ELU+1) at the same state: above at "
                                        f"{len(wins)} of {shared} shared points{untested}, below at none: "
                                        f"{_cells(wins)}", rule3))
        elif losses:
            out.append(Claim(NOT_SUPPORTED, f"delta holds more pairs than additive at the same state: "
                                            f"additive is higher at {len(losses)} of {shared} shared "
                                            f"points{untested}: {_cells(losses)}", rule3))
        else:
            out.append(Claim(NOT_SUPPORTED, "delta holds more pairs than additive at the same state: no difference "
                                            f"shown at any shared state (intervals overlap){untested}", rule3))
    else:
        out.append(Claim(NOT_APPLICABLE, "delta against additive: both need runs", rule3))
    return out


def _figure(agg, ctx, heads) -> str:
    """The accuracy-against-state figure: one column per number of pairs; one row, or one row per group of
    :data:`FIGURE_GROUPS` when more than :data:`FIGURE_ROW_MAX` layers ran (softmax in each row)."""
    if len(agg.layers) <= FIGURE_ROW_MAX:
        rows = [("", list(agg.layers))]
    else:
        rows = []
        for title, members in FIGURE_GROUPS:
            lay = [x for x in members if x in agg.layers]
            if lay:
                rows.append((title, lay + (["softmax"] if "softmax" in agg.layers else [])))
        grouped = {x for _, lay in rows for x in lay}
        rest = [x for x in agg.layers if x not in grouped]
        if rest:
            rows.append(("other layers", rest))
    fig, axes = ctx.figure(ncols=len(agg.kvs), nrows=len(rows), width=3.6, height=3.0)
    colour = {layer: i for i, layer in enumerate(agg.layers)}  # one style per layer in every row
    states_all = [st for kv in agg.kvs for layer in agg.layers for st in agg.series(kv, layer)[1]]
    xlim = (min(states_all) / 1.3, max(states_all) * 1.3)  # one state axis for every panel
    for r, (title, layers) in enumerate(rows):
        for c, kv in enumerate(agg.kvs):
            ax = axes[r * len(agg.kvs) + c]
            for layer in layers:
                dims, states, m, h, _ = agg.series(kv, layer)
                if not len(dims):
                    continue
                sty = ctx.style(colour[layer])
                ax.plot(states, m, ms=4, label=LAYERS[layer][0], **sty)
                ax.fill_between(states, np.clip(m - h, 0, 1), np.clip(m + h, 0, 1), color=sty["color"],
                                alpha=0.15, lw=0)
                fl = [recall_floor(layer, dim, kv, heads=heads) for dim in dims]
                if fl[0] is not None:
                    ax.plot(states, [f["recall_floor_accuracy"] for f in fl], ":", color=sty["color"], lw=1,
                            label="_")
            ax.axhline(ACCURACY, color="0.5", lw=0.8)
            ax.set(xscale="log", xlim=xlim, ylim=(-0.02, 1.02))
            if r == 0:
                ax.set_title(f"kv = {kv}")
            if r == len(rows) - 1:
                ax.set_xlabel("state (numbers per head and layer)", fontsize="small")
            if c == 0:
                ax.set_ylabel(f"{title}\naccuracy" if title else "accuracy")
            ax.grid(True, alpha=0.3)
    ctx.legend_outside(fig, axes, title=f"mean, 95% CI over {len(agg.seeds)} seeds")
    return "\n".join([
        ctx.savefig(fig, "mqar", "MQAR accuracy against state size, one panel per number of pairs"), "",
        f"{CI_CAPTION}; dotted: 1 − the least-squares error floor of the layer's state (the share of the values' "
        "energy the best state of that D_φ returns), not an accuracy bound."
        + (" One row per group of layers; softmax attention is drawn in each." if len(rows) > 1 else "")])


def render(records, ctx) -> Rendered:
    ok, failed, problems, failed_md = split_failed("mqar", records)
    md = []
    agg = _Agg(ok)
    if ok:
        p0 = ok[0]["params"]
        machines = sorted({r["result"].get("machine", "?") for r in ok})
        total = sum(r["result"]["seconds"] for r in ok)
        md.append(f"Regime: multi-query associative recall (Zoology, Arora et al. 2023), vocabulary {p0['vocab']}, "
                  f"sequence length max(64, 4·kv), a {LAYERS_N}-layer model of width {p0['d_model']}, "
                  f"{p0['heads']} head(s) of dimension d = M, a causal convolution of width {CONV} on q, k, v; "
                  f"AdamW lr {fmt(p0.get('lr', 3e-3))}, "
                  f"{p0['steps']} steps of batch 64 from {p0['n_train']} examples; accuracy on {p0['n_test']} held-out "
                  f"examples after the last step.  State: D_φ·M numbers per head and layer (ELU+1 and SiLU+L2 "
                  f"D_φ = d, DPFP and Hedgehog 2d, Taylor-2 1 + d + d(d+1)/2); softmax attention: its KV cache, "
                  f"length·2d.  {len(agg.seeds)} seeds; cells are {CI_CAPTION}.  Machine: {', '.join(machines)}; "
                  f"{len(ok)} runs, {fmt(total / 60.0)} min of training in all.")
        if p0["steps"] < 600:
            md.append(f"\nWith {p0['steps']} steps the models are far from trained (the whole grid uses 600): the "
                      "accuracies show how far training got, not the capacity of the layers.")
        # frontier table
        rows = []
        for layer in agg.layers:
            row = [LAYERS[layer][0]]
            for kv in agg.kvs:
                dims, states, m, h, _ = agg.series(kv, layer)
                # the smallest state whose mean accuracy reaches ACCURACY
                j = next((j for j in range(len(dims)) if m[j] >= ACCURACY), None)
                if j is not None:
                    row.append(f"{int(states[j])} (d = {dims[j]}: {pm(m[j], h[j])})")
                else:
                    row.append(f"> {int(states[-1])}" if len(dims) else "–")
            rows.append(row)
        md += ["", f"Smallest state (numbers per head and layer) at which the mean accuracy reaches {ACCURACY}, "
                   "with the head dimension and the accuracy there (\"> s\": not reached up to the largest state s):",
               "", markdown_table(["layer"] + [f"kv = {kv}" for kv in agg.kvs], rows)]
        # accuracy table
        rows = []
        for kv in agg.kvs:
            for layer in agg.layers:
                dims, states, m, h, n = agg.series(kv, layer)
                _, _, bm, bh, _ = agg.series(kv, layer, "best_accuracy")
                for j, dim in enumerate(dims):
                    fl = recall_floor(layer, dim, kv, heads=p0["heads"])
                    rows.append([kv, LAYERS[layer][0], dim, int(states[j]), pm(m[j], h[j]), pm(bm[j], bh[j]),
                                 "–" if fl is None else fmt(fl["optimal_mse"]), n[j]])
        md += ["", "Final and best accuracy per point; the least-squares floor is the relative retrieval error "
                   "of the best state of the same D_φ for kv one-hot values (an error floor: 0 while kv ≤ D_φ):",
               "", markdown_table(["kv", "layer", "d", "state", "final accuracy", "best accuracy",
                                   "least-squares error floor", "seeds"], rows)]
        claims = findings(agg)
        md += ["", "What it shows (computed from the tables above):", ""]
        md += [f"- {c.text} ({c.verdict}; rule: {c.rule})." for c in claims]
        stalls = stalled_runs(agg)
        if stalls:
            listed = "; ".join(f"{LAYERS[layer][0]} at kv = {kv}, d = {dim}, seed {seed}: {fmt(a)} against "
                               f"{fmt(best)}" for kv, layer, dim, seed, a, best in stalls[:10])
            more = f"; and {len(stalls) - 10} more (the table lists every point)" if len(stalls) > 10 else ""
            md += ["", f"{len(stalls)} of {len(ok)} runs ended more than {STALL_GAP} below the best seed of their "
                       f"point. The layer reached the higher accuracy with another seed at the same state, so the "
                       f"shortfall is that run's training, not the layer's capacity; the means and intervals above "
                       f"include these runs, which widens their points' intervals: {listed}{more}."]
        if ctx.plots:
            md += ["", _figure(agg, ctx, p0["heads"])]
    md += failed_md
    return Rendered("\n".join(md), f"{len(agg.layers)} layers, kv {agg.kvs}", problems)


STUDY = register_study(Study(
    name="mqar",
    title="MQAR recall frontier: trained accuracy against state size",
    command="mqar",
    help="train small models on multi-query associative recall: accuracy against state size per rule and map",
    points=points,
    run=run,
    render=render,
    figures=("mqar",),
    requires=requires_modules("torch", install="pip install 'linattn_nb[torch]'"),
    budget_s={"tiny": 30, "quick": 180, "full": 1200},
    # In the report when torch imports (its default profile trains 36 models, about 16 min on 2 cores);
    # without torch the report lists it as not run, with the install command (docs/mqar.md).
))
