"""A captured step's small inputs, packed where its graph reads them: one host buffer, one copy a step.

The MLX step uploads each of them as an array of its own (`kernels/upload.py`); a graph reads fixed addresses,
so the host writes them into `plan.staging`'s layout instead (`StepPlan.staging`: the step buffers by id, at
16-byte offsets) and copies the one buffer to the device before the replay. `step_values` makes the same int32
values `RowBatch.build` uploads, from the rows' Python ints: no MLX call, so packing a step costs microseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dsv4_serve.kernels.graph.plan import StepPlan
from dsv4_serve.kernels.rows import Row


class Staging:
    """`pack` writes each named step input at its offset of one reused host buffer."""

    def __init__(self, plan: StepPlan) -> None:
        self.fields = {plan.buffers[b].label: (off, plan.buffers[b].nbytes) for b, off in plan.staging.items()}
        self.host = np.zeros(plan.staging_bytes, np.uint8)

    def pack(self, values: Mapping[str, np.ndarray]) -> np.ndarray:
        """The staging bytes of one step (the same buffer each call); every field must be given, at its size."""
        missing = set(self.fields) - set(values)
        if missing:
            raise ValueError(f"staging: no value for {sorted(missing)}")
        for label, (off, n) in self.fields.items():
            v = np.ascontiguousarray(values[label]).reshape(-1).view(np.uint8)
            if v.nbytes != n:
                raise ValueError(f"staging: {label} is {v.nbytes} bytes, the graph reads {n}")
            self.host[off : off + n] = v
        return self.host


def step_values(rows: Sequence[Row], tokens: Sequence[int], table_width: Mapping[int, int]) -> dict[str, np.ndarray]:
    """The step's inputs by the names `model/graph_record.named_arrays` gives them, as RowBatch.build lays them out:
    tokens, slots, positions, q_rows [B] and each ratio's block table [B, width] padded with the trash page 0."""
    out = {"tokens": np.asarray(tokens, np.int32), "slots": np.asarray([r.slot for r in rows], np.int32),
           "positions": np.asarray([r.position for r in rows], np.int32),
           "q_rows": np.asarray([r.q_row for r in rows], np.int32)}  # fmt: skip
    for ratio, width in table_width.items():
        t = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            pages = r.tables.get(ratio, ())
            t[i, : len(pages)] = pages
        out[f"table{ratio}"] = t
    return out
