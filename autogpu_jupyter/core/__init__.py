"""The pure engine: no IPython, ipywidgets, tornado or Jupyter imports here (see docs/design)."""
