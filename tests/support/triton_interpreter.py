"""The Triton interpreter's patch, shared by conftest.py and the processes tests spawn (which run
no conftest)."""

from __future__ import annotations


def patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a loop bound with int(ndarray), which
    numpy >= 2.4 refuses for 1-element arrays of one dimension; read the element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter, "_verifypd_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._verifypd_patched = True
