"""The one exception type the planner raises for bad input.

``placement`` cannot import ``offload`` (DESIGN.md layering), so it carries its own error
type; ``offload.errors`` lists it among the user-facing errors the CLI turns into
``offload: error: <message>`` and exit status 2.
"""


class PlacementError(ValueError):
    """Bad placement input (device spec, rule, plan file, a plan that cannot fit).

    The message is one line that names the problem and, where there are numbers, shows them.
    """
