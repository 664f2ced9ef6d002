"""megarl.weights.optim_ckpt.contiguous_boxes: a distributed-optimizer rank's range of a flattened
parameter as rectangular chunks of the parameter (what its optimizer checkpoint writes)."""

import itertools

import numpy as np
import pytest

from megarl.weights.optim_ckpt import contiguous_boxes


def test_hand_computed_ranges():
    # rows of a 3 x 4 matrix: elements 2..10 = the end of row 0, row 1, the start of row 2
    assert contiguous_boxes((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    # a 2 x 3 x 4 tensor, elements 5..18: (0,1,1:4), (0,2,:), (1,0,:), (1,1,0:3)
    assert contiguous_boxes((2, 3, 4), 5, 19) == [((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)),
                                                  ((1, 0, 0), (1, 1, 4)), ((1, 1, 0), (1, 1, 3))]
    # aligned whole rows / slabs are one box
    assert contiguous_boxes((3, 4), 4, 12) == [((1, 0), (2, 4))]
    assert contiguous_boxes((2, 3, 4), 0, 24) == [((0, 0, 0), (2, 3, 4))]
    assert contiguous_boxes((7,), 2, 5) == [((2,), (3,))]
    assert contiguous_boxes((3, 4), 6, 6) == []


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (1, 6)])
def test_every_range_is_covered_once_in_order_by_contiguous_boxes(shape):
    index = np.arange(int(np.prod(shape))).reshape(shape)
    for start, stop in itertools.combinations_with_replacement(range(index.size + 1), 2):
        boxes = contiguous_boxes(shape, start, stop)
        covered = []
        for offset, size in boxes:
            assert all(o + s <= d for o, s, d in zip(offset, size, shape)), (shape, start, stop)
            block = index[tuple(slice(o, o + s) for o, s in zip(offset, size))].ravel()
            assert (np.diff(block) == 1).all()  # the box is one run of the flattened tensor
            covered += block.tolist()
        assert covered == list(range(start, stop)), (shape, start, stop)
        assert len(boxes) <= 2 * len(shape) - 1
