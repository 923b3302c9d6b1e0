"""Shim so that ``%load_ext autogpu`` works; everything lives in :mod:`autogpu_jupyter`."""

from autogpu_jupyter import load_ipython_extension, unload_ipython_extension

__all__ = ["load_ipython_extension", "unload_ipython_extension"]
