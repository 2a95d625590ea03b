"""Mutation testing for linattn_nb: plant one known bug at a time, check the tests catch it.

Each mutation in :data:`MUTATIONS` names a file of the package, an exact
source snippet that must occur in it exactly once, the snippet's
replacement (a realistic bug: an off-by-one causal bound, a wrong sign, a
dropped floor, a swapped index, a wrong coefficient), the pytest targets
that should catch it, and a one-line reason.

For every mutation the checkout is copied to a temporary folder (the
working tree is never edited, so an interrupted run loses nothing), the
snippet is replaced there, and ``python -m pytest -x -q -p no:cacheprovider
<targets>`` runs in the copy with the copy first on ``sys.path`` and a
kernel cache folder of its own (``LINATTN_CACHE_DIR``; the cache is keyed
on the package sources, so the mutated kernels compile fresh).  A mutation
is *caught* when the tests fail, *survived* when they pass, and *error*
when the snippet is not found exactly once, the copy does not import its
own package, or the run times out.

Usage::

    python tools/mutate.py --list
    python tools/mutate.py                      # all mutations
    python tools/mutate.py --only vec_exp_coef,sweep_error_replaces_ok
    python tools/mutate.py --jobs 2 --timeout 900 --keep

First the targets of the selected mutations run once on the unmutated
checkout (the baseline; ``--no-baseline`` skips it): a catch means nothing
when a target fails anyway, so a failing baseline stops the run (status 2).
The kernel cache it fills is reused by mutations of files without compiled
code (mutations of kernel files compile the kernels they reach afresh).

The exit status is 1 when any mutation survives or errors.  Not part of CI.
The CUDA device kernels and launch logic (ops/cuda/*.py,
ops/_cuda_launch.py, ops/_cuda_pool.py) carry mutations too, caught on the
simulator.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "tools" / "mutation_results.json"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One planted bug.

    Attributes
    ----------
    name : str
        Short unique identifier (used by ``--only``).
    file : str
        Path relative to ``linattn_nb/``.
    old : str
        Exact source snippet; must occur exactly once in ``file``.
    new : str
        Its replacement.
    targets : tuple of str
        Pytest node ids or test files (relative to the checkout root).
    why : str
        What the bug models.
    """

    name: str
    file: str
    old: str
    new: str
    targets: tuple[str, ...]
    why: str


def M(name, file, old, new, targets, why):  # noqa: N802  (short constructor for the table)
    if isinstance(targets, str):
        targets = (targets,)
    return Mutation(name, file, old, new, tuple(targets), why)


MUTATIONS: list[Mutation] = [
    # --- CPU kernels -------------------------------------------------------
    M("scan_excludes_diagonal", "ops/_rules.py",
      "            num[m] += c * s\n        return zi\n    if rule == RULE_DECAY",
      "            num[m] += c * (s - a * v[m])\n        return zi - a\n    if rule == RULE_DECAY",
      ("tests/test_linear_attention.py::test_causal_row_equals_normalised_prefix_sum",),
      "causal scan reads the state before the token's own update (strict causal bound)"),
    M("scan_floor_dropped", "ops/causal/cpu.py",
      "            elif norm == NORM_FLOOR and den < eps:\n                den = eps",
      "            elif norm == NORM_FLOOR and den < -eps:\n                den = eps",
      ("tests/test_linear_attention.py::test_custom_eps_floor", "tests/test_mutation_catches.py::test_eps_floor_every_cpu_method"),
      "scan's eps floor compares against the wrong sign: small normalisers are not floored"),
    M("scan_decay_factor_shifted", "ops/causal/cpu.py",
      "fa[:] = elu1(lg[b, t, 0])",
      "fa[:] = elu1(lg[b, t - 1, 0])",
      ("tests/ops/test_decay.py::test_edge_lengths[7_1-scan-decay]",),
      "decayed scan applies the previous token's factor (off by one token)"),
    M("chunked_mask_off_by_one", "ops/_rules.py",
      "        for t in range(r0, ce):\n            for j in range(t + 1, ce):\n                X[t, F + j] = zero\n    elif",
      "        for t in range(r0, ce):\n            for j in range(t + 2, ce):\n                X[t, F + j] = zero\n    elif",
      ("tests/ops/test_causal_chunked.py::test_chunk_boundaries[4-4-float64]",),
      "chunked intra-chunk causal mask lets token t see token t + 1"),
    M("chunked_token_range", "ops/_chunks.py",
      "return lo * unit, min(hi * unit, n)",
      "return lo * unit, min(hi * unit, n - 1)",
      ("tests/ops/test_causal_chunked.py::test_chunk_boundaries[7-3-float64]", "tests/ops/test_causal_chunked.py::test_segments_and_part_ranges"),
      "chunk/segment token range drops the sequence's last token"),
    M("chunked_floor_dropped", "ops/causal/chunked.py",
      "                elif norm == NORM_FLOOR and den < eps:\n                    den = eps\n                # an inf",
      "                elif norm == NORM_FLOOR and den < eps:\n                    den = den\n                # an inf",
      ("tests/ops/test_causal_chunked.py::test_chunk_boundaries[7-3-float64]", "tests/test_mutation_catches.py::test_eps_floor_every_cpu_method"),
      "chunked kernel forgets to floor the normaliser"),
    M("noncausal_block_boundary", "ops/noncausal/cpu.py",
      "        n = min(block, hi - s0)\n        fqn = fq[:n]",
      "        n = min(block, hi - s0 - 1)\n        fqn = fq[:n]",
      ("tests/ops/test_causal_chunked.py::test_noncausal_kernel_pieces_and_dtypes[float64]",),
      "non-causal query blocks skip the last token of every block"),
    M("noncausal_floor_sign", "ops/noncausal/cpu.py",
      "            elif norm == NORM_FLOOR and den < eps:\n                den = eps",
      "            elif norm == NORM_FLOOR and den < eps:\n                den = -eps",
      ("tests/ops/test_causal_chunked.py::test_noncausal_kernel_pieces_and_dtypes[float64]", "tests/test_mutation_catches.py::test_eps_floor_every_cpu_method"),
      "non-causal floor with the wrong sign"),
    M("step_swapped_row", "ops/step/cpu.py",
      "        out[b, t, m + 1] = acc1 / den",
      "        out[b, t, m + 1] = acc0 / den",
      ("tests/state/test_state.py::test_step_kernel_against_naive_recurrence",),
      "decode step writes row m's output into row m + 1 (swapped index)"),
    M("step_normaliser_stale", "ops/step/cpu.py",
      "        zb[i] = zi\n        den += fc[i] * zi\n    if not is_finite(den):",
      "        zb[i] = zi\n        den += fc[i] * (zi - fa[i])\n    if not is_finite(den):",
      ("tests/state/test_state.py::test_step_kernel_against_naive_recurrence",),
      "decode step's normaliser misses the current key"),
    M("softmax_causal_diagonal", "ops/softmax/cpu.py",
      "lim = max(0, min(nk, q0 + i + 1 - k0))",
      "lim = max(0, min(nk, q0 + i - k0))",
      ("tests/ops/test_softmax.py::test_matches_direct_softmax[129-float64-1e-12-True]",),
      "causal softmax excludes the diagonal key"),
    M("softmax_rescale_sign", "ops/softmax/cpu.py",
      "alpha = np.exp(mrow[i] - mx) if",
      "alpha = np.exp(mx - mrow[i]) if",
      ("tests/ops/test_softmax.py::test_block_sizes_partial_blocks[16-7-True]",),
      "online-softmax rescale factor with the wrong sign"),
    M("vec_exp_coef", "ops/_vec.py",
      "0.041668363013",
      "0.041686363013",
      ("tests/ops/test_causal_chunked.py::test_elu1_accuracy_and_specials[float32-1.5]",),
      "float32 vectorised exp: transposed digits in the x^4 coefficient"),
    M("vec_exp_flush", "ops/_vec.py",
      "p = p if not (x < np.float32(-87.3)) else np.float32(0.0)",
      "p = p if not (x < np.float32(-80.0)) else np.float32(0.0)",
      ("tests/ops/test_causal_chunked.py::test_elu1_accuracy_and_specials[float32-1.5]",),
      "float32 exp flushes to zero too early"),
    # --- naive references --------------------------------------------------
    M("naive_noncausal_state_overwritten", "ops/noncausal/naive.py",
      "S[b] += kf[b].T @ v[b]",
      "S[b] = kf[b].T @ v[b]",
      ("tests/state/test_state.py::test_noncausal_segments_accumulate_the_same_state",
       "tests/test_mutation_catches.py::test_noncausal_state_every_cpu_method_from_an_initial_state"),
      "non-causal reference forgets the initial state when it returns the new one"),
    M("naive_causal_floor", "ops/causal/naive.py",
      "            if eps is not None:\n                den = np.maximum(den, eps)",
      "            if eps is not None:\n                den = np.maximum(den, 0.0)",
      ("tests/test_linear_attention.py::test_custom_eps_floor", "tests/test_mutation_catches.py::test_eps_floor_every_cpu_method"),
      "causal reference floors at 0 instead of eps"),
    M("naive_softmax_axis", "ops/softmax/naive.py",
      "w /= w.sum(axis=-1, keepdims=True)",
      "w /= w.sum(axis=0, keepdims=True)",
      ("tests/ops/test_softmax.py::test_quadratic_method_and_float16",),
      "softmax reference normalises columns instead of rows"),
    # --- feature maps ------------------------------------------------------
    M("favor_key_half_sq_dropped", "feature_maps/_random.py",
      "            u = u - (half_sq[..., None] + self.key_shift)",
      "            u = u - self.key_shift",
      ("tests/feature_maps/test_feature_maps.py",),
      "favor+ keys lose the -|x|^2/2 term (the estimator is then biased)"),
    M("favor_vjp_half_sq_sign", "feature_maps/_random.py",
      "d_half_sq = -du.sum(axis=-1)",
      "d_half_sq = du.sum(axis=-1)",
      ("tests/feature_maps/test_feature_map_vjp.py::test_vjp_matches_finite_differences",),
      "favor+ key gradient: wrong sign of the |x|^2/2 term"),
    M("max_shift_vjp_dropped", "feature_maps/_base.py",
      "np.take_along_axis(du, a, axis=-1) - gf.sum(axis=-1, keepdims=True)",
      "np.take_along_axis(du, a, axis=-1)",
      ("tests/feature_maps/test_feature_map_vjp.py::test_vjp_matches_finite_differences",
       "tests/feature_maps/test_feature_map_vjp.py::test_max_shift_gradient_goes_to_the_argmax"),
      "query max-shift treated as a constant in the gradient"),
    M("taylor2_diag_coef", "feature_maps/_polynomial.py",
      "w = np.where(i == j, 1.0 / math.sqrt(2.0), 1.0)",
      "w = np.where(i == j, 0.5, 1.0)",
      ("tests/feature_maps/test_feature_maps.py::test_taylor2_exact_on_its_polynomial",),
      "taylor2 diagonal coefficient 1/2 instead of 1/sqrt(2)"),
    M("taylor2_vjp_diag", "feature_maps/_polynomial.py",
      "run[..., 0] *= 1.0 / math.sqrt(2.0)",
      "run[..., 0] *= 0.5",
      ("tests/feature_maps/test_feature_map_vjp.py::test_vjp_matches_finite_differences",),
      "taylor2 gradient of the squared terms with the wrong coefficient"),
    M("cosformer_length_off_by_one", "feature_maps/_positional.py",
      "        theta = (0.5 * np.pi / max(big_m, 1)) * (int(offset) + np.arange(n, dtype=np.float64))\n        r = np.maximum",
      "        theta = (0.5 * np.pi / max(big_m - 1, 1)) * (int(offset) + np.arange(n, dtype=np.float64))\n        r = np.maximum",
      ("tests/feature_maps/test_feature_maps.py::test_cosformer_weights_match_definition",),
      "cosformer angle step pi/2/(M - 1) instead of pi/2/M (off-by-one length)"),
    # --- state and file format ---------------------------------------------
    M("state_rule_step_position", "state/linear.py",
      "        self._position += 1\n",
      "        self._position += 0\n",
      ("tests/state/test_state_decay.py",
       "tests/test_mutation_catches.py::test_decay_state_one_token_steps_count_positions"),
      "the one-token fast path of the decay/delta states does not advance the position"),
    M("state_load_position", "state/linear.py",
      "new._position = sf.position",
      "new._position = 0",
      ("tests/state/test_state.py::test_save_load_round_trip_bit_exact",),
      "a loaded state restarts its position at 0"),
    M("state_copy_position", "state/linear.py",
      "new._position = self._position",
      "new._position = 0",
      ("tests/state/test_state.py::test_nbytes_copy_reset_and_interop",),
      "copy() loses the position"),
    M("file_newer_version_accepted", "state/fileformat.py",
      "if version > FORMAT_VERSION:",
      "if version > FORMAT_VERSION + 1:",
      ("tests/state/test_state.py::test_bad_files_rejected_with_clear_errors", "tests/test_mutation_catches.py::test_state_file_one_version_ahead_is_refused"),
      "a file from a newer format version is read"),
    M("file_normalize_dropped", "state/fileformat.py",
      "\"normalize\": np.array(-1 if normalize is None else int(bool(normalize)), dtype=np.int64),",
      "\"normalize\": np.array(-1, dtype=np.int64),",
      ("tests/state/test_state_decay.py", "tests/test_mutation_catches.py::test_state_file_keeps_normalize"),
      "save drops the normalize setting"),
    M("file_rule_unchecked", "state/fileformat.py",
      " or str(r) not in known:",
      ":",
      ("tests/state/test_state.py::test_bad_files_rejected_with_clear_errors", "tests/test_mutation_catches.py::test_state_file_unknown_rule_is_refused"),
      "an unknown update rule in a file is accepted"),
    M("file_version_keys", "state/fileformat.py",
      "if version >= v for k in keys)",
      "if version > v for k in keys)",
      ("tests/state/test_state.py::test_bad_files_rejected_with_clear_errors", "tests/test_mutation_catches.py::test_state_file_version_2_entries_are_required"),
      "version-2 files no longer need their version-2 entries"),
    # --- analysis formulas -------------------------------------------------
    M("error_tv_mean_max", "analysis/error.py",
      "tv_mean=float(tv.mean()),",
      "tv_mean=float(tv.max()),",
      ("tests/test_mutation_catches.py::test_approximation_error_summaries_against_explicit_weights",),
      "tv_mean reported as the maximum"),
    M("error_rel_denominator", "analysis/error.py",
      "ref = float(np.linalg.norm(o_sm))",
      "ref = float(np.linalg.norm(o_lin))",
      ("tests/test_mutation_catches.py::test_approximation_error_summaries_against_explicit_weights",),
      "output_rel_error divided by the linear output's norm"),
    M("theory_thm2_coefficient", "analysis/theory.py",
      "(m * (d + 2.0))",
      "(m * d)",
      ("tests/test_mutation_catches.py::test_orthogonal_mse_bound_is_theorem_2_written_out",),
      "Performer Theorem 2 with d instead of d + 2"),
    M("theory_trig_mse", "analysis/theory.py",
      "np.full_like(xy, -math.log(2.0 * m))",
      "np.full_like(xy, -math.log(m))",
      ("tests/analysis/test_theory.py",),
      "trig estimator MSE (Lemma 2) off by a factor 2"),
    M("capacity_nearest_sign", "analysis/capacity.py",
      "- 2.0 * (vhat @ v.T) + np.einsum",
      "- 2.0 * (vhat @ v.T) - np.einsum",
      ("tests/analysis/test_capacity.py", "tests/test_mutation_catches.py::test_nearest_accuracy_is_the_nearest_row_by_distance"),
      "nearest-neighbour read-out with the wrong sign of ||v_j||^2"),
    M("capacity_state_size", "analysis/capacity.py",
      "return heads * (value_dim * d_phi + d_phi) * itemsize",
      "return heads * (value_dim * d_phi) * itemsize",
      ("tests/analysis/test_capacity.py::test_state_size_counts_like_zoology",),
      "state size forgets the normaliser z"),
    # --- sweep runner ------------------------------------------------------
    M("sweep_error_replaces_ok", "studies/sweep.py",
      "        if prev is not None and prev.get(\"status\") == \"ok\" and rec.get(\"status\") != \"ok\":\n            continue\n",
      "",
      ("tests/studies/test_sweep.py::test_a_later_error_never_replaces_an_ok_record",),
      "a later error record replaces an earlier ok record for the same point"),
    M("sweep_resume_skips_errors", "studies/sweep.py",
      "done = {k for k, r in rf.latest.items() if r.get(\"status\") == \"ok\"}",
      "done = set(rf.latest)",
      ("tests/studies/test_sweep.py::test_errors_record_then_retry_on_resume",),
      "resume treats recorded errors as finished (never retried)"),
    # --- fitting losses ----------------------------------------------------
    M("fit_floor_term_dropped", "fitting/_kernels.py",
      "T[i, j] = keep * max(A[i, j] * inv, zero) + base",
      "T[i, j] = keep * max(A[i, j] * inv, zero)",
      ("tests/fitting/test_fitting.py::test_weights_loss_matches_naive",
       "tests/fitting/test_fitting.py::test_floored_loss_and_right_derivative_for_relu_features"),
      "floored weights lose the floor / n_i term"),
    M("fit_grad_sign", "fitting/_kernels.py",
      "coef = -keep * inv",
      "coef = keep * inv",
      ("tests/fitting/test_fitting.py::test_feature_gradients_match_finite_differences", "tests/fitting/test_fitting.py::test_floored_loss_and_right_derivative_for_relu_features"),
      "cross-entropy gradient with the wrong sign"),
    M("fit_block_grad_overwrite", "fitting/_objective.py",
      "dfk[bi, :kend] += A.T @ fq[bi, r0:r1]",
      "dfk[bi, :kend] = A.T @ fq[bi, r0:r1]",
      ("tests/fitting/test_fitting.py",),
      "key gradients of earlier row blocks overwritten, not summed"),
    M("fit_kl_entropy_sign", "fitting/_objective.py",
      "total -= self._entropy",
      "total += self._entropy",
      ("tests/fitting/test_fitting.py::test_objective_values_match_naive", "tests/test_mutation_catches.py::test_fitting_kl_and_cross_entropy_against_explicit_rows"),
      "KL loss adds the softmax entropy instead of subtracting it"),
    # --- CUDA launch logic (host side) ---------------------------------------
    M("seq_config_gate_factors_dropped", "ops/cuda/plan.py",
      "per_token = item * (2 * G * R + MBP + G * MBP + 1 + factors)",
      "per_token = item * (2 * G * R + MBP + G * MBP + 1)",
      ("tests/ops/test_seq_config.py",),
      "the row-group layout's shared-memory budget leaves out the staged factors"),
    M("seq_config_owner_z_rows_dropped", "ops/cuda/plan.py",
      "per_token = item * (3 * FPo + 2 * owner_row_pad(item) + 2 * MBP + 1 + factors)",
      "per_token = item * (2 * FPo + 2 * owner_row_pad(item) + 2 * MBP + 1 + factors)",
      ("tests/ops/test_seq_config.py",),
      "the owner layout's shared-memory budget leaves out z per token (the normaliser's rows)"),
    M("cuda_owner_normaliser_z_stale", "ops/cuda/owner.py",
      "                                    sz[t, i] = s\n",
      "                                    sz[t, i] = s - sk[t, i]\n",
      ("tests/ops/test_cuda.py::test_owner_layout_normaliser",),
      "owner layout: the normaliser reads z before the token's own key (strictly causal)"),
    M("cuda_auto_blocks_floor", "ops/_cuda_launch.py",
      "blocks = batch * -(-m // MB)",
      "blocks = batch * (m // MB)",
      ("tests/ops/test_cuda.py::test_auto_method_selection", "tests/test_mutation_catches.py::test_cuda_auto_counts_a_partial_column_block"),
      "auto selection counts column blocks rounding down"),
    M("cuda_pack_state_z_column", "ops/_cuda_launch.py",
      "view4(H[:, :, M]))",
      "view4(H[:, :, M - 1]))",
      ("tests/test_numerics.py::test_cuda_launchers_honour_check_finite", "tests/ops/test_cuda.py::test_check_finite_on_device", "tests/test_mutation_catches.py::test_cuda_initial_state_nonfinite_is_named"),
      "finiteness check of the initial z reads the last S column instead"),
    M("cuda_pool_count_last", "ops/_cuda_pool.py",
      "for idx in range(start, total, stride):\n        a0, a1, t, i = unravel4(idx, Bn, N, F)\n",
      "for idx in range(start, total - 1, stride):\n        a0, a1, t, i = unravel4(idx, Bn, N, F)\n",
      ("tests/ops/test_cuda.py::test_check_finite_on_device",
       "tests/test_mutation_catches.py::test_device_nonfinite_count_reaches_every_element"),
      "device NaN/inf count skips the last element"),
    M("cuda_pool_key_dtype", "ops/_cuda_pool.py",
      "key = (tag, shape, dt.str, _context_key(), threading.get_ident())",
      "key = (tag, shape, _context_key(), threading.get_ident())",
      ("tests/ops/test_cuda_transfers.py",),
      "workspace pool returns a buffer of another dtype for the same tag and shape"),
    M("cuda_step_prefill_grid", "ops/step/cuda.py",
      "kernels()[\"prefill\"][(B, F, (M + nt - 1) // nt), nt]",
      "kernels()[\"prefill\"][(B, F, max(1, M // nt)), nt]",
      ("tests/ops/test_step_cuda.py::test_cuda_state_matches_cpu_state",),
      "prefill grid rounds the column blocks down"),
    M("cuda_step_checked_in_place", "ops/step/cuda.py",
      "        return S.cur, z.cur, S.alt, z.alt",
      "        return S.cur, z.cur, S.cur, z.cur",
      ("tests/ops/test_step_cuda.py",),
      "a checked step updates the state in place, so a bad input corrupts it"),
    M("cuda_step_first_bad", "ops/step/cuda.py",
      "            return j + 1\n",
      "            return j\n",
      ("tests/ops/test_step_cuda.py",),
      "first bad input reported 0-based (q's NaN then reads as no error)"),
    # --- rescaled CUDA tiles, device rule inputs, the one-pass factor check ---
    M("cuda_rescaled_keys_times_p", "ops/cuda/blocks.py",
      "                    sk[tu, iu] /= p\n",
      "                    sk[tu, iu] *= p\n",
      ("tests/ops/test_decay_cuda.py::test_rescaled_and_direct_tiles",),
      "a rescaled tile's keys multiplied by the running factor instead of divided"),
    M("cuda_rescaled_floor_ignored", "ops/cuda/blocks.py",
      "        if not p >= tau:\n",
      "        if p != p:\n",
      ("tests/ops/test_decay_cuda.py::test_rescaled_and_direct_tiles", "tests/ops/test_decay_cuda.py::test_launchers_match_reference"),
      "tiles rescaled whatever their factor: a reset divides the keys by 0"),
    M("cuda_pool_range_upper_bound", "ops/_cuda_pool.py",
      "        if not (y >= lo and y <= hi):  # NaN fails both\n            bad += 1\n    if bad:",
      "        if not (y >= lo):\n            bad += 1\n    if bad:",
      ("tests/ops/test_cuda_transfers.py",),
      "device check of log_decay / beta misses values above the range"),
    M("factor_counts_no_upper", "_validate.py",
      "        bad += (v != v) | (v < lo) | (v > hi)",
      "        bad += (v != v) | (v < lo)",
      ("tests/test_decay_api.py",),
      "host check of decay / log_decay lets positive log-factors through"),
    M("decay_inputs_resets_kept", "_validate.py",
      "    elif resets:\n        lg = np.where(x <= LOG_RESET, -np.inf, x)",
      "    elif False:\n        lg = np.where(x <= LOG_RESET, -np.inf, x)",
      ("tests/test_decay_api.py",),
      "log-factors below exp's range are passed on instead of the exact reset -inf"),
    M("cuda_rows_rescale_end_dropped", "ops/cuda/rows.py",
      "fr = sp[row0 + r] if PER_ROW else ptile",
      "fr = sp[row0 + r] if PER_ROW else one",
      ("tests/ops/test_decay_cuda.py::test_rescaled_and_direct_tiles",),
      "row-group layout: a rescaled decay tile's state never scaled by the tile's factor"),
    M("cuda_seq_layout_boundary", "ops/_cuda_launch.py",
      "if sms > 1 and blocks < int(config.CUDA_AUTO_SCAN_BLOCKS_PER_SM) * sms:",
      "if sms > 1 and blocks <= int(config.CUDA_AUTO_SCAN_BLOCKS_PER_SM) * sms:",
      ("tests/ops/test_cuda.py::test_sequence_layout_choice",),
      "row groups taken when the owner layout's blocks exactly fill the GPU"),
    M("cuda_seq_layout_delta_rows", "ops/_cuda_launch.py",
      'return "tiles" if sms > 1 else "rows"',
      'return "tiles" if sms > 1 and segments < 4 * sms else "rows"',
      ("tests/ops/test_cuda.py::test_sequence_layout_choice",),
      "the delta rules back in row groups (a per-token k^T H sum across threads) once sequences fill the GPU"),
    M("cuda_rule_inputs_float32_converted", "_cuda_dispatch.py",
      "_IN_PLACE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))",
      "_IN_PLACE_DTYPES = (np.dtype(np.float64),)",
      ("tests/ops/test_cuda_transfers.py::test_device_log_decay_is_read_in_place",),
      "a float32 device log_decay converted into a float64 copy again (GLA's gates read, written, read)"),
    M("cuda_chunk_factors_sum_in_lf_dtype", "ops/cuda/helpers.py",
      "acc += float(lf[b, t, w])",
      "acc += lf[b, t, w]",
      ("tests/ops/test_decay_cuda.py::test_rule_inputs_checked_and_device_inputs_read_in_place",),
      "a chunk's log-factors summed in float32 when they come in float32 (the simulator's promotion)"),
    M("cuda_auto_rows_warps_as_blocks", "ops/_cuda_launch.py",
      "warps = blocks * -(-threads_per_block(R, C, G, MB, rule) // 32)",
      "warps = blocks",
      ("tests/ops/test_cuda.py::test_sequence_layout_choice",),
      "auto counts the row-group scan's blocks as its warps (chunked at the headline)"),
    M("cuda_delta_shuffle_one_level_short", "ops/cuda/rows.py",
      "x += cuda.shfl_xor_sync(lanes, x, G >> (lvl + 1))",
      "x += cuda.shfl_xor_sync(lanes, x, G >> (lvl + 2))",
      ("tests/ops/test_delta_cuda.py::test_row_group_reductions",),
      "delta rules: the warp-shuffle sum of k^T H stops one level short (half the row groups)"),
    M("cuda_delta_shared_sum_short", "ops/cuda/rows.py",
      "                                for g in range(G):\n                                    x += pu[buf, g, c0 + j]",
      "                                for g in range(G - 1):\n                                    x += pu[buf, g, c0 + j]",
      ("tests/ops/test_delta_cuda.py::test_row_group_reductions",),
      "delta rules, G not a power of two: the shared-memory sum of k^T H misses the last row group"),
    M("cuda_gated_delta_values_times_p", "ops/cuda/blocks.py",
      "sv[tu, ju] /= p",
      "sv[tu, ju] *= p",
      ("tests/ops/test_delta_cuda.py::test_gated_rescaled_and_direct_tiles",),
      "gated delta, rescaled tile: the values staged times P_t instead of divided by it"),
    M("cuda_gated_delta_tile_end_unscaled", "ops/cuda/rows.py",
      "st[r * C + j] *= ptile",
      "st[r * C + j] *= one",
      ("tests/ops/test_delta_cuda.py::test_gated_rescaled_and_direct_tiles",),
      "gated delta, rescaled tile: the state never scaled by the tile's factor at its end"),
    M("cuda_gated_delta_direct_unscaled", "ops/cuda/rows.py",
      "                                st[r * C + j] *= ft\n",
      "                                st[r * C + j] *= one\n",
      ("tests/ops/test_delta_cuda.py::test_gated_rescaled_and_direct_tiles",),
      "gated delta, direct form (below the floor): the state not scaled by the token's factor"),
    M("cuda_rule_input_decay_not_logged", "ops/_cuda_pool.py",
      "        if mode == 1:\n",
      "        if mode == 3:\n",
      ("tests/ops/test_cuda_transfers.py::test_device_decay_factors_are_converted_on_the_device",),
      "device decay= factors passed to the kernels as if they were log-factors"),
    M("cuda_rule_input_broadcast_counted", "ops/_cuda_pool.py",
      "and (s2 != 0 or t == 0)",
      "and (s2 != 0 or t >= 0)",
      ("tests/ops/test_cuda_transfers.py::test_device_decay_factors_are_converted_on_the_device",),
      "a bad per-sequence factor counted once per token it is broadcast to (a wrong count in the error)"),
    M("cuda_vec_v_block_offset", "ops/cuda/rows.py",
      "stage4(sv, t, j4, vb, IDX((t0u + t) * vn + m0u + j4)",
      "stage4(sv, t, j4, vb, IDX((t0u + t) * vn + j4)",
      ("tests/ops/test_cuda.py::test_vector_loads_agree_with_scalar_loads",),
      "row groups, vector loads of v: every column block reads the first block's columns"),
    M("cuda_vec_rows_normaliser_zero", "ops/cuda/rows.py",
      "fill4(sv, t, j4, MBP, zero, MB, one)",
      "fill4(sv, t, j4, MBP, zero, MB, zero)",
      ("tests/ops/test_cuda.py::test_vector_loads_agree_with_scalar_loads",),
      "row groups, vector loads of v: the normaliser's column of ones staged as zeros"),
    M("cuda_tiles_scores_unmasked_diagonal", "ops/cuda/tiles.py",
      "    return t, uint32(iu - t * (t + uint32(1)) // uint32(2))",
      "    return t, t",
      ("tests/ops/test_cuda.py::test_tile_layout",),
      "tile layout: every score of the tile's triangle computed as the diagonal's (phi(q_s)^T phi(k_s))"),
    M("cuda_tiles_normaliser_ones_dropped", "ops/cuda/tiles.py",
      "fill4(sv, t, j4, MP, zero, MB, one if t < ntu else zero)",
      "fill4(sv, t, j4, MP, zero, MB, zero)",
      ("tests/ops/test_cuda.py::test_tile_layout_wide",),
      "tile layout, vector loads of v: the normaliser's column of ones staged as zeros"),
    M("cuda_tiles_state_not_carried", "ops/cuda/tiles.py",
      "                        sst[r0 + uint32(a), j0 + uint32(j)] = st[a * 4 + j]\n",
      "                        pass\n",
      ("tests/ops/test_cuda.py::test_tile_layout",),
      "tile layout: the next tile reads the block's initial state, not the one updated by this tile"),
    M("cuda_tiles_scores_step_repeats", "ops/cuda/tiles.py",
      "x = sa[tt, su + uint32(a)]",
      "x = sa[tt, su]",
      ("tests/ops/test_cuda.py::test_tile_layout_four_tokens",),
      "tile layout, four scores a step (D_phi a multiple of 16): every step reads its first score four times"),
    M("cuda_tiles_state_step_repeats", "ops/cuda/tiles.py",
      "su = uint32(sb0 + uint32(e))",
      "su = uint32(sb0)",
      ("tests/ops/test_cuda.py::test_tile_layout_four_tokens",),
      "tile layout, four keys a step in the state update (D_phi a multiple of 16): every step adds its first key four times"),
    M("cuda_tiles_decay_weight_dropped", "ops/cuda/tiles.py",
      "                        x *= math.exp(_log_sum(sl, uint32(s + uint32(1)), uint32(t + uint32(1)), zero))\n",
      "                        pass\n",
      ("tests/ops/test_decay_cuda.py::test_decay_tile_layout",),
      "tile layout, decay: the tile's scores not weighted by a_{s+1} ... a_t (the additive rule's inside a tile)"),
    M("cuda_tiles_decay_weight_from_s", "ops/cuda/tiles.py",
      "_log_sum(sl, uint32(s + uint32(1)), uint32(t + uint32(1)), zero)",
      "_log_sum(sl, uint32(s), uint32(t + uint32(1)), zero)",
      ("tests/ops/test_decay_cuda.py::test_decay_tile_layout",),
      "tile layout, decay: key s's own factor a_s counted in its weight (an off-by-one in the sum)"),
    M("cuda_tiles_decay_start_state_unscaled", "ops/cuda/tiles.py",
      "                    x = sfp[tt]\n                    for j in range(4):\n                        ac[j] *= x\n",
      "                    x = sfp[tt]\n",
      ("tests/ops/test_decay_cuda.py::test_decay_tile_layout",),
      "tile layout, decay: token t reads the tile's start state undecayed"),
    M("cuda_tiles_decay_key_share_dropped", "ops/cuda/tiles.py",
      "                            x = ssh[su]\n                            for a in range(4):\n                                kk[a] *= x\n",
      "                            x = ssh[su]\n",
      ("tests/ops/test_decay_cuda.py::test_decay_tile_layout",),
      "tile layout, decay: the keys enter the end state without their share a_{s+1} ... a_{T-1}"),
    M("cuda_tiles_decay_state_not_decayed", "ops/cuda/tiles.py",
      "                    for i in range(16):\n                        st[i] *= x\n",
      "                    for i in range(16):\n                        pass\n",
      ("tests/ops/test_decay_cuda.py::test_decay_tile_layout",),
      "tile layout, decay: the state carried across a tile without the tile's factor"),
    M("cuda_tiles_gate_runs_from_own_block", "ops/cuda/tiles.py",
      "return uint32(T) + t, uint32(T) + s, _interval_row(bs + uint32(1), bt, NB)",
      "return uint32(T) + t, uint32(T) + s, _interval_row(bs, bt, NB)",
      ("tests/ops/test_decay_cuda.py::test_gate_tile_layout",),
      "tile layout, gate: a score across blocks weighted by the key's whole block too (its factors counted twice)"),
    M("cuda_tiles_gate_sigma_includes_own", "ops/cuda/tiles.py",
      "                                sk[T + 4 * bb + l, fu] = sk[4 * bb + l, fu] * x\n                                x *= ga[l]\n",
      "                                x *= ga[l]\n                                sk[T + 4 * bb + l, fu] = sk[4 * bb + l, fu] * x\n",
      ("tests/ops/test_decay_cuda.py::test_gate_tile_layout",),
      "tile layout, gate: sigma_s counts key s's own factor (an off-by-one in the products after s)"),
    M("cuda_tiles_gate_run_not_extended", "ops/cuda/tiles.py",
      "                                sz[1 + 3 * NB + lo * (2 * NB + 1 - lo) // 2 + bb - lo - 1, fu] * x)\n",
      "                                sz[1 + 3 * NB + lo * (2 * NB + 1 - lo) // 2 + bb - lo - 1, fu])\n",
      ("tests/ops/test_decay_cuda.py::test_gate_tile_layout",),
      "tile layout, gate: a run of two or more whole blocks missing its last block's factors"),
    M("cuda_tiles_gate_pair_product_wrong", "ops/cuda/tiles.py",
      "                        sz[2 + 3 * bb, fu] = ga[1] * ga[2]\n",
      "                        sz[2 + 3 * bb, fu] = ga[2]\n",
      ("tests/ops/test_decay_cuda.py::test_gate_tile_layout",),
      "tile layout, gate: the in-block pair (0, 2) weighted by a_2 alone, a_1 dropped"),
    M("cuda_tiles_gate_start_state_unscaled", "ops/cuda/tiles.py",
      "                            sq[uint32(T) + t, i4 + uint32(a)] *= sz[zr, i4 + uint32(a)]\n",
      "                            pass\n",
      ("tests/ops/test_decay_cuda.py::test_gate_tile_layout",),
      "tile layout, gate: token t reads the start state scaled by its block's factors only, not the blocks before"),
    M("cuda_tiles_gate_key_share_blocks_dropped", "ops/cuda/tiles.py",
      "                            sk[uint32(T) + t, i4 + uint32(a)] *= sz[zr, i4 + uint32(a)]\n",
      "                            pass\n",
      ("tests/ops/test_decay_cuda.py::test_gate_tile_layout",),
      "tile layout, gate: a key's share of the end state without the blocks after its own"),
    M("cuda_tiles_gate_state_not_gated", "ops/cuda/tiles.py",
      "                            st[a * 4 + j] *= x\n",
      "                            pass\n",
      ("tests/ops/test_decay_cuda.py::test_gate_tile_layout",),
      "tile layout, gate: the state carried across a tile without the tile's factors"),
    M("cuda_tiles_delta_w_without_beta", "ops/cuda/tiles.py",
      "                        x = sb[ju] if tu == ju else zero\n",
      "                        x = one if tu == ju else zero\n",
      ("tests/ops/test_delta_cuda.py::test_delta_tile_layout",),
      "tile layout, delta rules: W = L^-1 without diag(beta) (every key written at full strength)"),
    M("cuda_tiles_delta_l_without_beta", "ops/cuda/tiles.py",
      "                    w = sb[t]  # beta_t, times a_{s+1} ... a_t\n",
      "                    w = one  # beta_t, times a_{s+1} ... a_t\n",
      ("tests/ops/test_delta_cuda.py::test_delta_tile_layout",),
      "tile layout, delta rules: L's rows not scaled by their token's beta"),
    M("cuda_tiles_delta_solve_short", "ops/cuda/tiles.py",
      "                        for s in range(t):\n                            x -= sL[tu, uint32(s)] * sw[uint32(s), ju]\n",
      "                        for s in range(t - 1):\n                            x -= sL[tu, uint32(s)] * sw[uint32(s), ju]\n",
      ("tests/ops/test_delta_cuda.py::test_delta_tile_layout",),
      "tile layout, delta rules: the forward solve for W drops its last term (token t - 1's correction)"),
    M("cuda_tiles_delta_y_not_decayed", "ops/cuda/tiles.py",
      "                bt = sfp[tt] if DECAY else one  # a_0 ... a_tt (the delta rule: 1)\n",
      "                bt = one  # a_0 ... a_tt (the delta rule: 1)\n",
      ("tests/ops/test_delta_cuda.py::test_delta_tile_layout",),
      "tile layout, gated delta rule: the keys read the start state without the decay since the tile began"),
    M("cuda_tiles_delta_outputs_read_v", "ops/cuda/tiles.py",
      "                                ac[j] += x * sU[su + uint32(a), j0 + uint32(j)]\n",
      "                                ac[j] += x * sv[su + uint32(a), j0 + uint32(j)]\n",
      ("tests/ops/test_delta_cuda.py::test_delta_tile_layout",),
      "tile layout, delta rules: the outputs' tile term reads Y instead of U' = W Y"),
    M("cuda_off32_guard_inclusive", "ops/_cuda_launch.py",
      "sequence_span(x.shape, es) < OFF32_LIMIT",
      "sequence_span(x.shape, es) <= OFF32_LIMIT",
      ("tests/ops/test_cuda.py::test_32_and_64_bit_offsets_agree",),
      "a sequence spanning exactly 2^31 elements given 32-bit offsets"),
    M("cuda_vector_bits_alignment_ignored", "ops/cuda/views.py",
      "                and data_pointer(x) % align == 0)",
      "                and data_pointer(x) % 1 == 0)",
      ("tests/ops/test_cuda.py::test_vector_bits_need_aligned_unit_stride_inputs",),
      "vector loads chosen for a misaligned first element (a launch failure on a GPU)"),
]


def _check_unique(names):
    seen = set()
    for n in names:
        if n in seen:
            raise SystemExit(f"duplicate mutation name {n!r}")
        seen.add(n)


_check_unique(m.name for m in MUTATIONS)


def _checkout_files() -> list[str]:
    """The files of the working tree: tracked ones and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


def _copy_checkout(dest: pathlib.Path, files: list[str]) -> None:
    """Copy ``files`` (relative to the checkout root) to ``dest`` (uncommitted edits included)."""
    for rel in files:
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree but still in the index
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _env_for(copy: pathlib.Path, cache: pathlib.Path) -> dict:
    env = dict(os.environ)
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("LINATTN_NO_CACHE", None)
    env["LINATTN_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


_PROBE = ("import sys, linattn_nb; from linattn_nb import _cache; "
          "sys.stdout.write(linattn_nb.__file__ + '\\n' + str(_cache.cache_folder()[0]))")

# A file with none of these holds no compiled code, so no kernel inlines from it:
# a mutation there leaves every kernel's machine code valid, and its copy may
# start from the baseline's kernel cache (Numba still checks each kernel's own
# source file stamp).
_JIT_MARKERS = ("njit", "jit(", "@overload", "@intrinsic", "@register_jitable", "serial_and_parallel",
                "vectorize")


def _compiled(src: str) -> bool:
    return any(marker in src for marker in _JIT_MARKERS)


def _pytest(copy, env, targets, timeout):
    # -o addopts="": one process, as the exit status is read here (with the suite's pytest-xdist,
    # -x stops the workers and pytest exits 2, "interrupted", for a caught mutation)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *targets]
    return subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)


def _fresh_slot(slot: pathlib.Path, files) -> tuple[pathlib.Path, pathlib.Path]:
    """Empty ``slot`` and copy the checkout into ``slot/checkout``; returns (checkout, cache root)."""
    shutil.rmtree(slot, ignore_errors=True)
    copy, cache = slot / "checkout", slot / "cache"
    _copy_checkout(copy, files)
    cache.mkdir(parents=True)
    return copy, cache


def _probe(copy, env, timeout):
    probe = subprocess.run([sys.executable, "-c", _PROBE], cwd=copy, env=env, capture_output=True,
                           text=True, timeout=timeout)
    if probe.returncode != 0:
        raise _MutationError("the package fails to import: " + probe.stderr.strip()[-400:])
    pkg, folder = probe.stdout.split("\n")
    if not pathlib.Path(pkg).resolve().is_relative_to(copy.resolve()):
        raise _MutationError(f"the copy imports {pkg}, not its own package")
    return pathlib.Path(folder) if folder != "None" else None


def run_baseline(slot: pathlib.Path, files, targets, timeout: float) -> tuple[bool, str, pathlib.Path | None]:
    """Run every target on the unmutated checkout in ``slot``: they must pass for a catch to mean anything.

    Returns (passed, output tail, the kernel cache folder it filled).
    """
    copy, cache = _fresh_slot(slot, files)
    env = _env_for(copy, cache)
    folder = _probe(copy, env, timeout)
    proc = _pytest(copy, env, targets, timeout)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, "\n".join(out[-15:]), folder


def run_one(mut: Mutation, timeout: float, keep: bool, files: list[str], slot: pathlib.Path,
            warm: pathlib.Path | None = None) -> dict:
    """Apply ``mut`` in a fresh copy of the checkout (in ``slot``) and run its targets.

    ``warm``: the baseline's kernel cache folder, compiled in this same ``slot``
    path (Numba keys cached kernels on their source folder's absolute path);
    used when the mutated file holds no compiled code.

    Returns
    -------
    dict
        ``name``, ``file``, ``targets``, ``status`` (``caught``, ``survived``
        or ``error``), ``caught_by`` (the first failing test), ``seconds``,
        ``warm`` and ``detail`` (the tail of the output, or why the mutation
        is an error).
    """
    t0 = time.perf_counter()
    result = {"name": mut.name, "file": mut.file, "targets": list(mut.targets), "why": mut.why,
              "caught_by": "", "warm": False}
    try:
        copy, cache = _fresh_slot(slot, files)
        path = copy / "linattn_nb" / mut.file
        if not path.is_file():
            raise _MutationError(f"no file linattn_nb/{mut.file}")
        src = path.read_text()
        count = src.count(mut.old)
        if count != 1:
            raise _MutationError(f"snippet occurs {count} times in {mut.file} (must be once)")
        path.write_text(src.replace(mut.old, mut.new))
        for t in mut.targets:
            if not (copy / t.split("::")[0]).exists():
                raise _MutationError(f"no test file {t.split('::')[0]}")
        env = _env_for(copy, cache)
        folder = _probe(copy, env, timeout)
        if warm is not None and folder is not None and warm.is_dir() and not _compiled(src):
            shutil.copytree(warm, folder, dirs_exist_ok=True)
            result["warm"] = True
        try:
            proc = _pytest(copy, env, mut.targets, timeout)
        except subprocess.TimeoutExpired:
            raise _MutationError(f"timed out after {timeout:.0f} s") from None
        out = (proc.stdout + proc.stderr).strip().splitlines()
        if proc.returncode == 0:
            result["status"] = "survived"
        elif proc.returncode == 1:
            result["status"] = "caught"
        else:  # 2: interrupted/collection error, 4: usage, 5: no tests collected
            result["status"] = "error"
        failed = [ln for ln in out if ln.startswith(("FAILED", "ERROR"))]
        result["caught_by"] = failed[0] if failed else ""
        result["detail"] = "\n".join(out[-3:])
    except _MutationError as exc:
        result["status"] = "error"
        result["detail"] = str(exc)
    finally:
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if keep and (slot / "checkout").is_dir():
            kept = slot.parent / "kept" / mut.name
            kept.parent.mkdir(exist_ok=True)
            shutil.move(str(slot / "checkout"), kept)
            result["copy"] = str(kept)
    return result


class _MutationError(Exception):
    pass


def _union_targets(muts) -> list[str]:
    """The targets of ``muts`` once each (a node id is dropped when its whole file is a target)."""
    whole = {t for m in muts for t in m.targets if "::" not in t}
    out = []
    for m in muts:
        for t in m.targets:
            if t not in out and t.split("::")[0] not in whole - {t}:
                out.append(t)
    return out


def _table(results) -> str:
    rows = [("name", "status", "s", "file", "caught by")]
    for r in results:
        by = r.get("caught_by", "") if r["status"] == "caught" else r.get("detail", "").splitlines()[-1:] and r["detail"].splitlines()[-1]
        rows.append((r["name"], r["status"], f"{r['seconds']:.0f}", r["file"], by[:110]))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--only", default="", help="comma-separated mutation names")
    p.add_argument("--jobs", type=int, default=1, help="mutations run at once (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per mutation")
    p.add_argument("--keep", action="store_true", help="keep the mutated copies (paths printed)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the run of the targets on the unmutated checkout (and its warm kernel cache)")
    p.add_argument("--json", default=str(DEFAULT_JSON),
                   help=f"results file (default {DEFAULT_JSON.relative_to(ROOT)}); '' for none")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")

    muts = MUTATIONS
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {m.name for m in MUTATIONS}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            p.error(f"--only: unknown mutation(s) {', '.join(unknown)}")
        muts = [m for m in MUTATIONS if m.name in wanted]

    if args.list:
        for m in muts:
            print(f"{m.name:32s} {m.file:28s} {m.why}\n{'':32s} -> {' '.join(m.targets)}")
        print(f"{len(muts)} mutations")
        return 0

    t0 = time.perf_counter()
    files = _checkout_files()
    work = pathlib.Path(tempfile.mkdtemp(prefix="linattn-mutate-"))
    slots = queue.Queue()
    for i in range(args.jobs):
        slots.put(work / f"slot{i}")
    warm = None
    results = []
    try:
        if not args.no_baseline:
            targets = _union_targets(muts)
            print(f"baseline: {len(targets)} targets on the unmutated checkout ...", flush=True)
            try:
                ok, tail, folder = run_baseline(work / "slot0", files, targets, args.timeout * 2)
            except (_MutationError, subprocess.TimeoutExpired) as exc:
                ok, tail, folder = False, str(exc), None
            print(f"baseline: {'passed' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if not ok:
                print(tail)
                print("the targets must pass without a mutation; fix them first")
                return 2
            if folder is not None and folder.is_dir():
                warm = work / "warm"
                shutil.copytree(folder, warm)

        def task(m):
            slot = slots.get()
            try:
                # the warm cache was compiled at slot0's path, so it serves slot0 only
                return run_one(m, args.timeout, args.keep, files, slot,
                               warm if slot.name == "slot0" else None)
            finally:
                slots.put(slot)

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futs = [pool.submit(task, m) for m in muts]
            for f in concurrent.futures.as_completed(futs):
                r = f.result()
                results.append(r)
                print(f"[{len(results)}/{len(muts)}] {r['name']}: {r['status']} ({r['seconds']:.0f} s"
                      f"{', warm cache' if r['warm'] else ''})"
                      + (f"  kept at {r['copy']}" if r.get("copy") else ""), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    order = {m.name: i for i, m in enumerate(muts)}
    results.sort(key=lambda r: order[r["name"]])
    total = time.perf_counter() - t0
    print()
    print(_table(results))
    bad = [r for r in results if r["status"] != "caught"]
    print(f"\n{len(results) - len(bad)}/{len(results)} caught, {len(bad)} survived or errored, "
          f"{total:.0f} s")
    if args.json:
        path = pathlib.Path(args.json)
        merged = {}
        if path.is_file():
            try:
                merged = {r["name"]: r for r in json.loads(path.read_text())["results"]}
            except (ValueError, KeyError, TypeError):
                merged = {}
        merged.update({r["name"]: r for r in results})
        merged = {k: v for k, v in merged.items() if k in {m.name for m in MUTATIONS}}
        rows = sorted(merged.values(), key=lambda r: [m.name for m in MUTATIONS].index(r["name"]))
        path.write_text(json.dumps({"results": rows}, indent=1) + "\n")
        print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
