"""A traffic file as the plugin's recorder writes it (vllm_metax.core.traffic), for the traffic tests."""

from vllm_metax.core import traffic as rec


def binned(decode: dict) -> dict:
    """(batch, context, q_len) -> steps as the recorder keys them (contexts of one bin add up)."""
    out: dict = {}
    for (b, c, q), n in decode.items():
        k = (b, q, rec.fine_bin(c))
        out[k] = out.get(k, 0) + n
    return out


def write_traffic(path, dims, decode: dict, prefill: dict | None = None, device: str | None = None):
    """decode (batch, context, q_len) -> steps, prefill (causal, query tokens, KV per request) ->
    plans, added into the traffic file at `path` for model `dims`; returns `path`."""
    rec.write_counts(str(path), dims, binned(decode),
                     {(c, rec.fine_bin(q), rec.fine_bin(k)): n for (c, q, k), n in (prefill or {}).items()},
                     device_name=device)
    return path
