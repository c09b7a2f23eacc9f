"""Triton kernels run on the CPU here, under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported). On a machine with a GPU these tests are skipped and the variable is left alone
(it is process-wide: it would put tests/gpu's kernels under the interpreter too); the kernels are
checked there by tests/gpu.

NOTE: triton 3.6's interpreter turns a scalar tensor into a Python int with `int(array)`, which
numpy >= 2.4 refuses for its 1-element arrays (a loop `range(start, end, step)` with bounds loaded
from memory hits it); the patch below reads the element instead.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton.runtime.interpreter as _interp
except ImportError:  # pragma: no cover - the tests skip without triton
    _interp = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="CPU interpreter tests: with a GPU, tests/gpu checks the kernels")
    for item in items:
        if ON_GPU and "tests/kernels/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


if _interp is not None and hasattr(_interp, "_patch_lang_tensor"):
    _original = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):  # noqa: ANN001, ANN202 - triton's own signature
        _original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor
