"""Mainstay trainer client: push gradients, finish steps, pull quantized parameters.

Everything of the compiled extension ``mainstay._mainstay`` is re-exported here, so
``mainstay.Client``, ``mainstay.Layout``, ``mainstay.Error``, ... are what they always were.
``mainstay.torch`` (the PyTorch optimizer wrapper) is a submodule that is imported only on
request: ``import mainstay`` never imports torch.
"""


def _cannot_load(error):
    """The ImportError to raise when the compiled extension does not load into this interpreter:
    it names the interpreter the package was built for (mainstay/_build.py, written by CMake)
    and how to run it, instead of a bare "No module named 'mainstay._mainstay'"."""
    import glob
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from ._build import PYTHON_EXECUTABLE as built_for
    except ImportError:
        built_for = "the Python it was built with"
    built = sorted(os.path.basename(f) for f in glob.glob(os.path.join(here, "_mainstay*.so")))
    this = "%s (Python %d.%d)" % (sys.executable or "this interpreter", sys.version_info[0], sys.version_info[1])
    lines = ["mainstay: the compiled extension mainstay._mainstay does not load into %s: %s." % (this, error)]
    if not built:
        lines.append("There is no _mainstay*.so in %s: build the project first (README, cmake --build build)." % here)
    else:
        lines.append("This package (%s) was built for %s as %s. Run your script with that interpreter, e.g.\n"
                     "    PYTHONPATH=%s %s your_script.py\n"
                     "or rebuild the module for this one: cmake -S . -B build -DPYTHON_EXECUTABLE=%s "
                     "(it needs that Python's development headers and pybind11)."
                     % (here, built_for, ", ".join(built), os.path.dirname(here), built_for, sys.executable))
    return ImportError("\n".join(lines))


try:
    from . import _mainstay
except ImportError as _error:
    raise _cannot_load(_error) from _error
from ._mainstay import *  # noqa: F401,F403,E402
from .reader import WeightReader  # noqa: E402

__doc__ = _mainstay.__doc__ or __doc__
__all__ = [name for name in dir(_mainstay) if not name.startswith("_")] + ["WeightReader"]
