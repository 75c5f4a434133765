"""What the Hub's client raises when the Hub was not reached: told the same way by `upload` and `load_medbanana`."""

# Exception modules of the HTTP stacks huggingface_hub may use: their errors mean the endpoint was not reached.
_NETWORK_MODULES = {"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3", "ssl", "socket"}


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the endpoint was not reached (refused, unresolved, timed out), whatever HTTP stack
    huggingface_hub used."""
    return isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.split(".")[0] in _NETWORK_MODULES
