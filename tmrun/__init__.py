"""tmrun: launch PyTorch distributed training that survives failures and drains.

The ``tmrun`` command lives in :mod:`tmrun.cli`; this package's top level stays light so that a
training script's ``import tmrun`` costs nothing it does not use.
"""

__version__ = "0.1.0"
