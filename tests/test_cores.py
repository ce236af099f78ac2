"""lm_head in row blocks on several CPU streams gives exactly the logits of the whole weight."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from qmtp import cores


@pytest.mark.parametrize("bits", [None, 3, 4, 6, 8])
@pytest.mark.parametrize("parts", [2, 3])
def test_split_equals_whole(bits, parts):
    mx.random.seed(0)
    linear = nn.Linear(256, 1000, bias=False)
    if bits is not None:
        linear = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=bits)
    x = mx.random.normal((2, 3, 256))
    split = cores.RowSplitLinear(linear, parts)
    assert mx.array_equal(split(x), linear(x)).item()


def test_split_only_where_it_pays(monkeypatch):
    small = nn.Linear(64, 1024, bias=False)
    wide = nn.QuantizedLinear.from_linear(nn.Linear(2048, 8192, bias=False), group_size=64, bits=4)
    assert cores.split_lm_head(small, parts=2) is None
    assert cores.split_lm_head(nn.Linear(4096, 4096, bias=True), parts=2) is None
    assert isinstance(cores.split_lm_head(wide, parts=2), cores.RowSplitLinear)
    monkeypatch.setenv("QMTP_CORES", "1")
    assert cores.split_lm_head(wide) is None
    monkeypatch.setenv("QMTP_CORES", "3")
    assert len(cores.split_lm_head(wide).streams) == 3
