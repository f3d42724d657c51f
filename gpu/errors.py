"""The gpu package's user-error type (a bad setting, e.g. an environment variable). It cannot
import ``offload``; ``offload.errors.USER_ERRORS`` lists it, so the CLI reports it as one
line with exit status 2. Imports nothing (``offload.errors`` must stay torch-free)."""


class GpuSettingError(ValueError):
    """Bad input to the GPU path: the message is one line that names the problem."""
