"""The global view's strict checks at scale: boxes that tile a tensor pass in about one comparison per box, any
overlap or gap is refused, and no tensor lists more boxes than there are ranks."""

from __future__ import annotations

import pytest

from lazyckpt.errors import CheckpointFormatError
from lazyckpt.format import schema
from lazyckpt.format.schema import check_global_tensors


def _rows(ranks: int, rows_each: int = 2, cols: int = 8) -> dict:
    boxes = [{"rank": r, "offsets": [r * rows_each, 0], "lengths": [rows_each, cols]} for r in range(ranks)]
    return {"w": {"dtype": "F32", "shape": [ranks * rows_each, cols], "boxes": boxes}}


def _grid(rows: int, cols: int) -> dict:
    boxes = [{"rank": r * cols + c, "offsets": [r, c], "lengths": [1, 1]} for r in range(rows) for c in range(cols)]
    return {"w": {"dtype": "F32", "shape": [rows, cols], "boxes": boxes}}


@pytest.mark.parametrize("index, ranks, most", [(_rows(2048), 2048, 2048), (_grid(32, 32), 1024, 32 * 1024)])
def test_a_tiling_is_checked_with_about_one_comparison_per_box_not_one_per_pair(monkeypatch, index, ranks, most):
    calls = []
    real = schema._overlap
    monkeypatch.setattr(schema, "_overlap", lambda a, b: calls.append(1) or real(a, b))
    check_global_tensors(index, ranks, "manifest.json")
    assert len(calls) <= most, f"{len(calls)} box comparisons for {ranks} boxes"


def test_overlapping_boxes_and_gaps_are_refused():
    overlapping = _grid(4, 4)
    overlapping["w"]["boxes"][5] = {"rank": 5, "offsets": [0, 0], "lengths": [1, 1]}  # on top of rank 0's box
    with pytest.raises(CheckpointFormatError, match="overlapping boxes on ranks 0 and 5"):
        check_global_tensors(overlapping, 16, "manifest.json")
    gap = _rows(4)
    del gap["w"]["boxes"][2]
    with pytest.raises(CheckpointFormatError, match="boxes cover 48 of the 64 elements"):
        check_global_tensors(gap, 4, "manifest.json")


def test_a_tensor_listing_more_boxes_than_ranks_is_refused():
    with pytest.raises(CheckpointFormatError, match="lists 8 boxes, more than world_size=4"):
        check_global_tensors(_rows(8), 4, "manifest.json")
