"""qmtp.book.under_load's memory per decoding row matches the arrays a row holds, and the largest batch is what is left."""

import mlx.core as mx
from mlx.utils import tree_flatten

from qmtp import decoding
from qmtp.book import under_load
from qmtp.config import QWEN36_35B_A3B
from test_speculative import model  # noqa: F401 (fixture)


def test_row_memory_is_the_state_a_row_holds(model):
    capacity = 256
    state = decoding.empty_state(model, capacity, head=True)
    held = sum(a.nbytes for _, a in tree_flatten(state) if isinstance(a, mx.array) and a.ndim > 1)  # not the offsets
    row = under_load.row_memory(model.config, context=capacity, n_draft=1, dtype_bytes=4)
    assert row.snapshot_bytes == 0
    assert row.kv_bytes + row.head_kv_bytes + row.linear_bytes == held
    assert under_load.row_memory(model.config, capacity, n_draft=3, dtype_bytes=4).snapshot_bytes == 3 * row.linear_bytes


def test_the_largest_batch_grows_with_the_machine():
    fits = under_load.batch_fits(QWEN36_35B_A3B, machines_gb=(24, 64, 128))
    assert [f["largest_batch"] for f in fits] == sorted(f["largest_batch"] for f in fits)
    row = under_load.row_memory(QWEN36_35B_A3B).total_bytes
    for f in fits:
        n = f["largest_batch"]
        free = f["machine_GB"] * 1e9 * (1 - under_load.OS_SHARE) - f["weights_GB"] * 1e9 - under_load.RUNTIME_BYTES
        assert n * row <= max(free, 0) < (n + 1) * row
