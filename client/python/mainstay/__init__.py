"""Mainstay trainer client: push gradients, finish steps, pull quantized parameters.

Everything of the compiled extension ``mainstay._mainstay`` is re-exported here, so
``mainstay.Client``, ``mainstay.Layout``, ``mainstay.Error``, ... are what they always were.
``mainstay.torch`` (the PyTorch optimizer wrapper) is a submodule that is imported only on
request: ``import mainstay`` never imports torch.
"""
from . import _mainstay
from ._mainstay import *  # noqa: F401,F403

__doc__ = _mainstay.__doc__ or __doc__
__all__ = [name for name in dir(_mainstay) if not name.startswith("_")]
