"""The learning-aware losses' vector helpers make no tensor off the device and dtype of the data they meet.

The meta device stands in for a GPU (as in ``test_device_guard``): a result on the
CPU, or of the default dtype, shows there as a wrong device or dtype, and
:class:`~tests.device_guard.DeviceGuard` records any factory call made without a device.
"""

from __future__ import annotations

import pytest
import torch

from nip_like.objectives.learning_aware.second_order import _dot, _flat, _unflat
from tests.device_guard import DeviceGuard


def test_vector_helpers_keep_the_device_and_dtype_of_the_data_they_meet():
    like = torch.zeros((), device="meta", dtype=torch.float64)
    vector = [torch.ones(3, device="meta", dtype=torch.float64), torch.ones(2, 2, device="meta", dtype=torch.float64)]
    with DeviceGuard() as guard:
        results = [_dot(vector, vector), _flat(vector), _dot([], [], like=like), _flat([], like=like)]
        parts = _unflat(results[1], vector)
    assert not guard.found, guard.found
    assert [(r.device.type, r.dtype) for r in (*results, *parts)] == [("meta", torch.float64)] * 6
    assert [tuple(r.shape) for r in results] == [(), (7,), (), (0,)]
    assert [tuple(part.shape) for part in parts] == [(3,), (2, 2)]


def test_an_empty_vector_without_a_tensor_to_follow_is_refused():
    with pytest.raises(ValueError, match=r"^an empty parameter vector has no device or dtype: pass like="):
        _dot([], [])
    with pytest.raises(ValueError, match="pass like="):
        _flat([])
