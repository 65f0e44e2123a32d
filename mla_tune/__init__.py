"""mla-tune: measure MLA decode attention candidates on this GPU and emit a tuned config for vLLM."""

__version__ = "0.1.0"
