# SPDX-License-Identifier: Apache-2.0
"""ZigzagAttention (Liu et al., 2025): layer-exclusive head patterns, each layer all-retrieval or all-streaming."""
from __future__ import annotations

import datetime
import math

import numpy as np

from vllm_duo.pattern import HeadPattern, PatternError, resolve_pattern

DEFAULT_OMEGA = 0.1
METHOD = "ZigzagAttention layer-exclusive selection"
# s * L is computed in floating point; 0.35 * 10 must round to 4 like 3.5 does.
_ROUND_EPSILON = 1e-9


def num_streaming_layers(sparsity: float, num_layers: int) -> int:
    """p = round(sparsity * num_layers), halves rounded up (Python's round() would send 2.5 to 2 but 3.5 to 4)."""
    _check_sparsity(sparsity)
    return min(num_layers, math.floor(sparsity * num_layers + 0.5 + _ROUND_EPSILON))


def layer_costs(gates: np.ndarray, head_mask: np.ndarray,
                omega: float = DEFAULT_OMEGA) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer transport costs from the head-level mask (True = retrieval): (to_streaming, to_retrieval).

    to_streaming[l] = sum of the gates of layer l's retrieval heads (each one turned streaming costs its gate);
    to_retrieval[l] = omega * sum of the gates of layer l's streaming heads.
    """
    gates = np.asarray(gates, dtype=float)
    head_mask = np.asarray(head_mask, dtype=bool)
    return np.where(head_mask, gates, 0.0).sum(axis=1), omega * np.where(head_mask, 0.0, gates).sum(axis=1)


def select_streaming_layers(to_streaming: np.ndarray, to_retrieval: np.ndarray, num_streaming: int) -> np.ndarray:
    """Bool [L] mask of the `num_streaming` layers that minimise the total cost; True = streaming layer.

    A choice S of streaming layers costs
        C(S) = sum_{l in S} to_streaming[l] + sum_{l not in S} to_retrieval[l]
             = sum_l to_retrieval[l] + sum_{l in S} (to_streaming[l] - to_retrieval[l]).
    The first sum does not depend on S and each layer adds its own difference d_l independently of the others,
    so over all S with |S| = p the minimum is reached by the p layers with the smallest d_l: swapping any chosen
    layer for an unchosen one with a smaller difference would lower C. The result is exact, not a heuristic,
    and takes O(L log L). Equal differences go to the lower layer index, so the same input gives the same mask
    (among all optimal S, this one has the lexicographically smallest sorted layer indices).
    """
    differences = np.asarray(to_streaming, dtype=float) - np.asarray(to_retrieval, dtype=float)
    if not 0 <= num_streaming <= differences.size:
        raise PatternError(f"cannot make {num_streaming} of {differences.size} layers streaming: pass 0 to "
                           f"{differences.size}")
    order = np.lexsort((np.arange(differences.size), differences))  # last key first: difference, then layer
    streaming = np.zeros(differences.size, dtype=bool)
    streaming[order[:num_streaming]] = True
    return streaming


def zigzag_mask(gates: np.ndarray, sparsity: float, omega: float = DEFAULT_OMEGA) -> np.ndarray:
    """Bool [L, H] layer-exclusive mask (True = retrieval; every row all True or all False) at `sparsity`.

    Starts from the head-level binarization of `gates` at the same sparsity (HeadPattern.retrieval_mask_at) and
    makes round(sparsity * L) layers streaming at the least transport cost (see select_streaming_layers).
    """
    gates = np.asarray(gates, dtype=float)
    if gates.ndim != 2 or gates.size == 0 or not np.isfinite(gates).all():
        raise PatternError(f"gates of shape {gates.shape} are not a finite [layers, KV heads] matrix: pass gates")
    _check_sparsity(sparsity)
    _check_omega(omega)
    head_mask = HeadPattern._binarize(gates, sparsity)
    return _layer_exclusive(gates, head_mask, num_streaming_layers(sparsity, gates.shape[0]), omega)


def zigzag_pattern(pattern: HeadPattern, sparsity: float, omega: float = DEFAULT_OMEGA, *,
                   origin: str | None = None, date: str | None = None) -> HeadPattern:
    """`pattern` with a layer-exclusive retrieval_mask at `sparsity`, `layer_exclusive` set and gates kept.

    The stored sparsity is the realized fraction of streaming heads, (streaming layers) / L. `origin` names the
    source pattern in the provenance (default: its label); `date` defaults to today.
    """
    if pattern.gates is None:
        raise PatternError(f"{pattern.label} stores only a retrieval mask, not gates, so there is nothing to weigh "
                           "layers by: use a pattern with gates (e.g. from `vllm-duo pattern convert`)")
    _check_sparsity(sparsity)
    _check_omega(omega)
    gates = np.array(pattern.gates)
    num_layers = pattern.model.num_layers
    num_streaming = num_streaming_layers(sparsity, num_layers)
    mask = _layer_exclusive(gates, pattern.retrieval_mask_at(sparsity), num_streaming, omega)
    source = origin or pattern.label
    note = (f"Layer-exclusive mask by ZigzagAttention (Liu et al., 2025) from {source} at sparsity {sparsity:g}, "
            f"omega {omega:g}: {num_streaming} of {num_layers} layers streaming; gates kept as in the source.")
    old = pattern.provenance
    data = pattern.model_dump()
    data.update(
        retrieval_mask=mask.astype(int).tolist(),
        masks=None,  # head-level masks trained for the source: not layer-exclusive
        sparsity=num_streaming / num_layers,
        layer_exclusive=True,
        provenance={
            "source": old.source,
            "method": f"{METHOD} (omega {omega:g}, sparsity {sparsity:g}, from {source}) of: {old.method}",
            "date": date or datetime.date.today().isoformat(),
            "license": old.license,
            "notes": f"{note} Source notes: {old.notes}" if old.notes else note,
        },
    )
    return HeadPattern.model_validate(data)


def write_zigzag(spec: str, out: str, sparsity: float, omega: float = DEFAULT_OMEGA) -> str:
    """`vllm-duo pattern zigzag`: writes the layer-exclusive pattern of `spec` to `out`; returns a summary line."""
    pattern, source = resolve_pattern(spec)
    zigzag = zigzag_pattern(pattern, sparsity, omega, origin=source)
    zigzag.save(out)
    mask = np.array(zigzag.retrieval_mask, dtype=bool)
    head_mask = pattern.retrieval_mask_at(sparsity)
    streaming = [layer for layer in range(mask.shape[0]) if not mask[layer, 0]]
    to_streaming, to_retrieval = layer_costs(np.array(pattern.gates), head_mask, omega)
    cost = float(np.where(mask[:, 0], to_retrieval, to_streaming).sum())
    return (f"wrote {out}: {len(streaming)} of {mask.shape[0]} layers streaming (sparsity {zigzag.sparsity:.4f}, "
            f"omega {omega:g}, cost {cost:.4f}, {int((mask != head_mask).sum())} heads changed from the head-level "
            f"mask), streaming layers {streaming}")


def _layer_exclusive(gates: np.ndarray, head_mask: np.ndarray, num_streaming: int, omega: float) -> np.ndarray:
    streaming = select_streaming_layers(*layer_costs(gates, head_mask, omega), num_streaming)
    return np.repeat(~streaming[:, None], gates.shape[1], axis=1)


def _check_sparsity(sparsity: float) -> None:
    if not 0.0 <= sparsity <= 1.0:  # also rejects NaN
        raise PatternError(f"sparsity {sparsity} is outside [0, 1]: pass the fraction of streaming layers, e.g. 0.5")


def _check_omega(omega: float) -> None:
    if not 0.0 <= omega < math.inf:  # also rejects NaN
        raise PatternError(f"omega {omega} is not a finite weight >= 0: pass e.g. 0.1")
