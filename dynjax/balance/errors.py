"""The one error the balancers raise on an impossible request."""


class InfeasibleError(ValueError):
    """No layout satisfies the constraints (too few layers, memory over capacity, ...).

    A ``ValueError`` so callers that validate Plans can catch both alike; the message says why.
    """
