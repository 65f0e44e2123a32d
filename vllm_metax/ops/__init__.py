"""vllm-free MLA kernel path: block table -> plan metadata -> FlashInfer wrapper plan/run.

The tuner (mla_tune) and the vLLM backend (vllm_metax.backend) both call exactly these functions.
"""
