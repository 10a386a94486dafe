"""Linear layers with weights prepacked for oneDNN on CPU.

``F.linear`` on a plain ``[out, in]`` weight makes oneDNN reorder the weight
into its blocked layout on every call.  Reordering once at load time
(``mkldnn._reorder_linear_weight``) and calling ``mkldnn._linear_pointwise``
is what ``torch.compile``'s CPU freezing pass does; measured on this machine
for the 121 products of one SmolLM2-135M decode step in bf16 (2 threads):

====  ==============  ==========
rows  ``F.linear``    prepacked
====  ==============  ==========
1     17.1 ms         11.3 ms
16    28.5 ms         15.0 ms
64    66.8 ms         39.0 ms
====  ==============  ==========

Batch invariance: a row's result does not depend on the rows around it from
two rows on.  A single row takes a matrix-vector path that rounds differently
(float32: always; bf16: seen on the 1536-wide down projection with the real
weights, not with random ones), hence :data:`MIN_ROWS`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Fewest rows a product runs with (see module docstring).
MIN_ROWS = 2


def _can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and torch.backends.mkldnn.is_available()


class Linear:
    """``y = x @ weight.T + bias``, the same for a row alone or among any others."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.prepacked = _can_prepack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 64) if self.prepacked else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < MIN_ROWS:
            return self(torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])]))[:rows]
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
