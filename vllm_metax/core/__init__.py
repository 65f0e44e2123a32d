"""The plugin's vllm-free core: what the tuner, the bench scripts, `mla-tune doctor` and the vLLM
glue all decide by, written once. Standard library only at module level (the plugin reads its
config while vLLM starts; `tests/test_layering.py` checks every module here):

* tuned_config/: the tuned-config schema, its parsing, files and discovery;
* choices.py, split_facts.py: each kernel family's knobs and legal values, the split kernel's facts;
* decisions.py: backend values per device, the model key, the lookup statistics, what a bucket serves;
* serving.py: which tuned entry a server runs with (the one config lookup), the MLA backend order;
* device.py, distribution.py, log.py: the device, who else installs `vllm_metax`, the loggers.
"""
