"""The sequence kernel: one kernel per configuration of its thread layouts, and its launch signature.

See ``docs/cuda_kernels.md``, "The kernel's arguments".
"""
from __future__ import annotations

from .._codes import RULE_ADDITIVE
from .._cuda_common import is_delta_rule
from .owner import owner_kernel
from .plan import TILES_RULES
from .rows import rows_kernel
from .tiles import tiles_kernel

_SEQ_KERNELS: dict = {}


def seq_kernel(R: int, C: int, G: int, MB: int, T: int, acc: str, rule: int = RULE_ADDITIVE, code=None,
               off32: bool = True, vec: int = 0):
    """The sequence kernel of the owner, row-group or tile layout specialised on its compile-time constants.

    ``(R, C, G, MB, T)`` from :func:`seq_config`; ``acc`` the accumulation dtype name;
    ``rule`` the update-rule code; ``code`` the feature map (None: any, branching per
    element); ``off32`` 32-bit element offsets; ``vec`` the vector-load bits.  The
    launch grid and arguments: ``docs/cuda_kernels.md``, "The kernel's arguments".
    """
    key = (int(R), int(C), int(G), int(MB), int(T), str(acc), int(rule), None if code is None else int(code),
           bool(off32), int(vec))
    kern = _SEQ_KERNELS.get(key)
    if kern is not None:
        return kern
    R, C, G, MB, T = key[:5]
    rule = key[6]
    if G == 0:
        if rule not in TILES_RULES or C != 4 or R % 4 or T != R // 4:
            raise ValueError(f"the tile layout (G = 0) is that of the rules of TILES_RULES, with C = 4, T = R / 4; "
                             f"got {key}")
        kern = tiles_kernel(R, MB, acc, key[7], key[8], key[9], rule)
    elif G == 1 and not is_delta_rule(rule):
        kern = owner_kernel(R, C, MB, T, acc, rule, key[7], key[8], key[9])
    else:
        kern = rows_kernel(R, C, G, MB, T, acc, rule, key[7], key[8], key[9])
    _SEQ_KERNELS[key] = kern
    return kern


def seq_signature(in_dtype: str, acc: str, lf_dtype: str = "float64") -> tuple:
    """The Numba signature the launchers give the sequence kernel: 1-d views of ``in_dtype``, element
    strides, int64 sizes and flags, states of ``acc``, log-factors of ``lf_dtype``, int32 counters.
    """
    from numba import types

    a1 = types.Array(getattr(types, in_dtype), 1, "C")
    st = types.UniTuple(types.int64, 4)
    H = types.Array(getattr(types, acc), 3, "C")
    lf = types.Array(getattr(types, lf_dtype), 3, "C")
    i, b = types.int64, types.boolean
    return ((a1,) * 4 + (st,) * 4 + (i, i, H, H, lf) + (i,) * 6 + (types.float64, i) + (b,) * 4
            + (types.Array(types.int32, 1, "C"),))
