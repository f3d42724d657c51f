"""offload: hybrid CPU/GPU runtime for Mixture-of-Experts GGUF models.

``offload.load(model_path, ...)`` returns a ``Session`` (see ``offload.runtime.load``).
Importing ``offload`` stays light (no torch): the runtime is imported on first use, so
``offload plan`` starts instantly.
"""


def load(model_path, **kwargs):
    """Load a GGUF model by placement; see ``offload.runtime.load`` for the options."""
    from offload.runtime import load as _load
    return _load(model_path, **kwargs)
