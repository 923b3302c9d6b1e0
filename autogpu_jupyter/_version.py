# This file is rewritten by hatch's version hook at build time.
__version__ = VERSION = "0.1.0"
