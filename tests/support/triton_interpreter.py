"""The Triton interpreter's patch, shared by conftest.py and the processes tests spawn (which run
no conftest)."""

from __future__ import annotations


def patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a loop bound with int(ndarray), which
    numpy >= 2.4 refuses for 1-element arrays of one dimension; read the element instead. And its
    float -> float8e4nv cast rounds half up and drops the carry into the exponent (7.76 becomes 4.0,
    not 8.0), where the GPU's cvt rounds to nearest even: casts to and from e4m3 go through torch's,
    which rounds as the hardware does."""
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
    interpreter._convert_float = _e4m3_through_torch(interpreter._convert_float)
    interpreter._verifypd_patched = True


def _e4m3_through_torch(original):
    import numpy as np
    import torch
    import triton.language as tl

    wide = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def as_torch(data, dtype):
        if dtype == tl.bfloat16:  # stored as its uint16 bits
            return torch.from_numpy(np.ascontiguousarray(data).view(np.int16).copy()).view(torch.bfloat16)
        if dtype == tl.float8e4nv:  # stored as its uint8 bits
            return torch.from_numpy(np.ascontiguousarray(data).copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.ascontiguousarray(data).copy())

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in wide:
            return as_torch(data, input_dtype).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        if input_dtype == tl.float8e4nv and output_dtype in wide:
            out = as_torch(data, input_dtype).to(wide[output_dtype])
            return (out.view(torch.int16) if output_dtype == tl.bfloat16 else out).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    return convert
