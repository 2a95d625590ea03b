"""Modelled global-memory traffic and FLOPs of linattn_nb's CUDA launch plans, without a GPU.

A development tool for ``benchmarks/gpu_static.py`` (its tables of bytes per stream and FLOPs
against the minimum and the roofline), kept outside the package next to ``cuda_resources.py``:
its users put ``tools/`` on ``sys.path`` and ``import cuda_traffic``.  What the model counts:
docs/cuda_kernels.md, "The traffic and FLOP model".
"""
from __future__ import annotations

import numpy as np

from linattn_nb.ops._codes import RULE_ADDITIVE, RULE_DECAY, RULE_GATED_DELTA
from linattn_nb.ops._cuda_common import is_delta_rule, rule_factor_rows
from linattn_nb.ops._cuda_launch import SeqPlan, chunk_length, seq_layout
from linattn_nb.ops.cuda.plan import acc_name, seq_config, threads_per_block

_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)


def traffic_model(plan_or_shape, *, method: str = "scan", dtype="float32", rule: int = RULE_ADDITIVE,
                  chunk=None, sms=None, factor_dtype="float64", range_check: bool = False) -> dict:
    """Modelled global-memory bytes and FLOPs of one launcher call (``docs/cuda_kernels.md``).

    Parameters
    ----------
    plan_or_shape : SeqPlan or tuple
        A :class:`SeqPlan`, or ``(B, N, F, M)``: batch entries, tokens, features, values.
    method : {"scan", "chunked", "aggregate"}
        The launcher (causal ``chunked`` of one chunk, and of the delta rules, runs the scan).
    dtype : str or numpy.dtype
        dtype of q, k, v and the output (a plan: that of its q).
    rule : int
        Update-rule code (a plan: its own).
    chunk : int, optional
        Tokens per chunk (a plan: its own; default ``config.CUDA_CHUNK_SIZE``).
    sms : int, optional
        Multiprocessors the layout is chosen for (a shape only; default 1).
    factor_dtype : str or numpy.dtype
        dtype of the decay and gate rules' log-factors as read (a shape only);
        the delta rules' packed inputs are float64.
    range_check : bool
        Count the front end's range check of device rule inputs as part ``checks``.

    Returns
    -------
    dict
        ``bytes``, ``parts`` (bytes per stream: ``q``, ``k``, ``v``, ``out``,
        ``factors``, ``states``, ``checks``), ``flops`` (an FMA counts 2),
        ``flops_ratio`` (to ``4 B N F M``), ``launches``, ``config``
        ``(R, C, G, MB, T)``, ``layout``, ``warps`` (of the last launch), ``method``.
    """
    if isinstance(plan_or_shape, SeqPlan):
        p = plan_or_shape
        B, N, F, M = p.B, p.N, p.F, p.M
        item = np.dtype(p.q.dtype).itemsize
        fitem = np.dtype(p.lf.dtype).itemsize
        acc = np.dtype(p.acc)
        rule = p.rule
        L = p.chunk if method != "scan" else max(N, 1)
    else:
        B, N, F, M = (int(x) for x in plan_or_shape)
        item = np.dtype(dtype).itemsize
        fitem = 8 if is_delta_rule(rule) else np.dtype(factor_dtype).itemsize
        if np.dtype(factor_dtype) not in (_F32, _F64):
            raise ValueError(f"factor_dtype must be float32 or float64, got {np.dtype(factor_dtype)}")
        acc = np.dtype(acc_name(dtype))
        L = chunk_length(chunk) if method != "scan" else max(N, 1)
    nc = max(-(-N // L), 1)
    if method == "chunked" and (nc == 1 or is_delta_rule(rule)):
        method, nc, L = "scan", 1, max(N, 1)
    if isinstance(plan_or_shape, SeqPlan):
        R, C, G, MB, T = plan_or_shape.cfg
    else:
        R, C, G, MB, T = seq_config(F, M, acc.itemsize, rule,
                                      seq_layout(B * nc, F, M, acc.itemsize, rule, sms=1 if sms is None else sms))
    tiles = G == 0
    owner = G == 1 and not is_delta_rule(rule)
    A = acc.itemsize
    S = F * (M + 1)  # state elements per batch entry
    W = rule_factor_rows(rule, F)
    # per state element and token: the update (2), a factor (1 more), the delta rules' read k^T H (2 more)
    per_elem_update = 2 if rule == RULE_ADDITIVE else 4 if is_delta_rule(rule) else 3
    reduce_adds = (-(-MB // C)) if owner else G * (MB + 1)  # per token and column block
    cb = -(-M // MB)
    out_flops = B * N * (2 * S + cb * reduce_adds + M)  # phi(q)^T [S | z], the sums, the divisions
    upd_flops = B * N * per_elem_update * S
    query_flops = out_flops
    if tiles:  # padded 4 x 4 tiles (R = padded F, MB + 1 columns padded to MP), no cross-thread sums
        MP = -(-(MB + 1) // 4) * 4
        upd_flops = B * N * cb * 2 * R * MP
        query_flops = B * N * (cb * 2 * R * MP + M)
        # the tile's own tokens: (T + 1) / 2 scores of R products per token, T x MP products (the
        # masked half is multiplied by its zeros)
        out_flops = query_flops + B * N * cb * ((T + 1) * R + 2 * T * MP)
        if rule in (RULE_DECAY, RULE_GATED_DELTA):  # the keys' shares (4 per thread and token), the start
            # state's factor per output, the state's factor once a tile; per score a sum of up to T
            # log-factors and its exp
            upd_flops += B * N * cb * (R * MP // 4 + -(-R * MP // T))
            out_flops += B * N * cb * (MP + (T + 1) // 2 * (T // 2 + 1))
        if is_delta_rule(rule):  # per token: the key's read of the start state and Y = [v | 1] minus it,
            # its (T - 1) / 2 entries of L, its row of U' = W Y (the masked half multiplied by zeros) and
            # a T-th of the solve for W (T^3 / 6 FMAs a tile)
            upd_flops += B * N * cb * (2 * R * MP + MP + (T - 1) * R + 2 * T * MP + -(-T * T // 3))
    parts = {"q": B * N * F * item, "k": B * N * F * item, "v": B * N * M * item, "out": B * N * M * item,
             "factors": B * N * W * fitem * (cb if W else 0), "states": 0,
             "checks": B * N * W * fitem if range_check else 0}
    launches = 1
    if method == "scan":
        flops = upd_flops + out_flops
        if A == 8 and cb == 1:
            parts["states"] = 2 * B * S * 8
        else:  # cast-copies around the kernel
            parts["states"] = B * S * (8 + A) + B * S * 2 * A + B * S * (A + 8)
            launches += 2
    elif method == "chunked":
        flops = 2 * upd_flops + out_flops + B * nc * S * 2
        # (1) k, v and the chunk sums out; (2) sums in and prefixes out (float64 H in and out);
        # (3) q, k, v, the prefixes in, the outputs out
        parts["k"] *= 2
        parts["v"] *= 2
        parts["factors"] *= 2
        parts["states"] = B * nc * S * A + (2 * B * nc * S * A + 2 * B * S * 8) + B * nc * S * A
        launches += 2 + (1 if W else 0)
    elif method == "aggregate":
        flops = upd_flops + query_flops + B * nc * S
        parts["states"] = B * nc * S * A + (B * nc * S * A + 2 * B * S * 8 + B * S * A) + B * nc * S * A
        launches += 2
    else:
        raise ValueError(f"method must be 'scan', 'chunked' or 'aggregate', got {method!r}")
    total = sum(parts.values())
    return {"bytes": int(total), "parts": {k: int(v) for k, v in parts.items()}, "flops": int(flops),
            "flops_ratio": flops / max(1, 4 * B * N * F * M), "launches": launches,
            "config": (R, C, G, MB, T), "layout": "tiles" if tiles else "owner" if owner else "rows",
            "warps": B * nc * cb * -(-threads_per_block(R, C, G, MB, rule) // 32), "method": method}
