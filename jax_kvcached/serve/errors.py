"""What the serving loop answers a request or command it cannot serve (the routes map
each to its HTTP status)."""


class Overloaded(RuntimeError):
    """The model's request queue is full (HTTP 429)."""


class Unavailable(RuntimeError):
    """The loop is not running or the model's engine failed (HTTP 503)."""


class UnknownModel(KeyError):
    """No engine serves this model (HTTP 404)."""


class Conflict(RuntimeError):
    """The model is not in a state the command applies to (HTTP 409): waking an awake
    model, putting a sleeping one to sleep, no idle model to make room for a wake."""
