"""Triton kernels, a kernel per file: the only modules of verifypd that import Triton.

Nothing imports them at module level outside this package: the model imports a kernel inside the
branch that runs it (CUDA, or Triton's CPU interpreter in tests), so a CPU install, whose torch wheel
brings no Triton, never needs it. Each kernel has a torch rule beside its caller that CPU runs use and
the kernel's tests compare against."""
