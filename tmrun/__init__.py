"""tmrun: launch PyTorch distributed training that survives failures and drains.

The ``tmrun`` command lives in :mod:`tmrun.cli`; this package's top level stays light so that a
training script's ``import tmrun`` costs nothing it does not use.
"""

__version__ = "0.1.0"
__all__ = ["heartbeat", "init", "Run", "StepFailed", "__version__"]


from tmrun.liveness import heartbeat  # noqa: E402 (no torch: a torchrun script's one line)


def __getattr__(name: str):
    # ``tmrun.init`` and friends import torch; the CLI must not pay for that.
    if name in ("init", "Run", "StepFailed"):
        from tmrun import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'tmrun' has no attribute {name!r}")
