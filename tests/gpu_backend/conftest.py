"""Fixtures of the engine's tests: the Triton kernels, interpreted on a CPU.

Without CUDA the `kernels` fixture sets TRITON_INTERPRET=1 and (re)imports the kernel modules for the
test module that asks for it; at teardown it restores the environment (and triton.language, see
_interpret_triton_stdlib) and re-imports the kernels in compiled mode, so nothing leaks into other test
files.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()

KERNEL_MODULES = ("gpu_backend.ops.triton_tile", "gpu_backend.ops.triton_cache",
                  "gpu_backend.ops.triton_decode", "gpu_backend.ops.triton_prefill",
                  "gpu_backend.ops.triton_layer", "gpu_backend.ops.triton_backend")


def _import_kernels():
    """(Re)import the kernel modules so @triton.jit sees the current TRITON_INTERPRET."""
    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        module = importlib.reload(module) if module else importlib.import_module(name)
    return module  # triton_backend


def _interpret_triton_stdlib(patch: pytest.MonkeyPatch) -> None:
    """Swap triton.language's own @jit helpers (tl.zeros, tl.sum, tl.max...) for interpreted ones.

    They were decorated when triton was first imported; if that happened without TRITON_INTERPRET
    (another test module imported triton first) the interpreter cannot call them. Undone at teardown.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for module in (tl, tl.standard, tl.math):
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                patch.setattr(module, name, InterpretedFunction(obj.fn))


@pytest.fixture(scope="module")
def kernels():
    """The triton_backend module, interpreted on CPU for the duration of this test module."""
    if ON_GPU:
        yield importlib.import_module("gpu_backend.ops.triton_backend")
        return
    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    try:
        _interpret_triton_stdlib(patch)
        yield _import_kernels()
    finally:
        patch.undo()  # environment and triton.language restored
        _import_kernels()  # and the kernels rebuilt in compiled mode
