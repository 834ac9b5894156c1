"""Documents that stay apart in a window of the token stream, Megatron-LM's `--reset-attention-mask
--reset-position-ids --eod-mask-loss`: each token's segment (the document it belongs to; an end-of-document token
ends its own), its position within that document, and a loss mask that drops the one target that crosses a boundary
(the first token of the next document, predicted from an end-of-document token).

Shapes: R rows, S sequence. numpy only: the loader computes them on the host with the rows it reads.
"""
from __future__ import annotations

import numpy as np

FIELDS = ("segment_ids", "positions", "loss_mask")


def document_fields(inputs_RS: np.ndarray, eod_id: int) -> dict[str, np.ndarray]:
    """{"segment_ids", "positions", "loss_mask"} of rows of input tokens whose documents end with `eod_id`."""
    eod_RS = inputs_RS == eod_id
    segments_RS = (np.cumsum(eod_RS, axis=1) - eod_RS).astype(np.int32)  # an eod belongs to the document it ends
    index_RS = np.broadcast_to(np.arange(inputs_RS.shape[1], dtype=np.int32), inputs_RS.shape)
    starts_RS = np.concatenate([np.ones_like(eod_RS[:, :1]), segments_RS[:, 1:] != segments_RS[:, :-1]], axis=1)
    positions_RS = index_RS - np.maximum.accumulate(np.where(starts_RS, index_RS, 0), axis=1)
    return {"segment_ids": segments_RS, "positions": positions_RS.astype(np.int32),
            "loss_mask": (~eod_RS).astype(np.float32)}
