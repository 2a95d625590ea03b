"""Analysis tools: how linear attention relates to softmax attention.

Approximation error at the attention level (:mod:`.error`) and kernel-level
theory (:mod:`.theory`).  Importing compiles nothing.
"""
from .error import ApproximationError, approximation_error, approximation_error_naive, attention_weights
from .theory import KernelEstimate, favor_mse, kernel_estimate_mse, orthogonal_mse_bound
