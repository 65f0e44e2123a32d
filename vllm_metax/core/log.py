"""The plugin's loggers: children of vLLM's `vllm` logger.

vLLM configures only the `vllm` logger hierarchy (its handler, format and level; `propagate` off).
A logger named `vllm_metax...` has no handler under `vllm serve`: its INFO lines never reach the
server log and its warnings reach stderr unformatted. `vllm.vllm_metax...` is printed by vLLM's
own handler, in its format, in every process (API server, engine core, workers). Stdlib only, so
`import vllm_metax` stays cheap; without vLLM's configuration the records propagate as usual.
"""

from __future__ import annotations

import logging

PARENT = "vllm"


def get_logger(module: str) -> logging.Logger:
    """The logger of a plugin module (pass `__name__`): `vllm.<module>`."""
    return logging.getLogger(f"{PARENT}.{module}")


_SAID: set = set()


def log_once(logger: logging.Logger, level: int, msg: str, *args) -> None:
    """`logger.log` the first time this exact line would be logged in this process."""
    key = (logger.name, level, msg, args)
    if key in _SAID:
        return
    _SAID.add(key)
    logger.log(level, msg, *args, stacklevel=2)
