"""lm_head in row blocks on several CPU streams gives exactly the logits of the whole weight."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from qmtp import blas, cores


@pytest.mark.parametrize("bits", [None, 3, 4, 6, 8])
@pytest.mark.parametrize("parts", [2, 3])
def test_split_equals_whole(bits, parts):
    mx.random.seed(0)
    linear = nn.Linear(256, 1000, bias=False)
    if bits is not None:
        linear = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=bits)
    x = mx.random.normal((2, 3, 256))
    split = cores.RowSplitLinear(linear, parts)
    if bits is None and blas.loaded:  # OpenBLAS rounds by the product's shape: equal up to float32 rounding
        assert mx.allclose(split(x), linear(x), rtol=1e-5, atol=1e-5).item()
    else:
        assert mx.array_equal(split(x), linear(x)).item()


def test_float_weights_are_not_split_under_openblas(monkeypatch):
    wide = nn.Linear(4096, 8192, bias=False)
    monkeypatch.setattr(blas, "loaded", "/usr/lib/libopenblas.so.0")
    assert cores.split_lm_head(wide, 2) is None
    monkeypatch.setattr(blas, "loaded", None)
    assert cores.split_lm_head(wide, 2) is not None


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
