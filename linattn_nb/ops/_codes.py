"""Integer codes shared by the kernels and the Python side.

This module imports nothing, so any module (``feature_maps`` included) can
import it without a cycle; Numba reads these module-level integers as
compile-time constants.

Feature-map codes (``code=`` of every launcher): the elementwise map the
kernels apply to ``q`` and ``k`` themselves.  :mod:`linattn_nb.feature_maps`
re-exports them as ``KERNEL_CODE_*`` and each built-in map names its code.

Update-rule codes (``rule=`` of the CPU kernels' hooks,
:mod:`linattn_nb.ops._rules`): how a token or a chunk changes the state
``H = [S | z]``.
"""

#: The inputs already are features: used as they are.
KERNEL_CODE_NONE = 0
#: ELU(x) + 1.
KERNEL_CODE_ELU = 1
#: max(x, 0).
KERNEL_CODE_RELU = 2
#: max(x, 0) ** 2.
KERNEL_CODE_SQUARED_RELU = 3

#: H += phi(k)^T [v 1]: the additive rule of linear attention.
RULE_ADDITIVE = 0
