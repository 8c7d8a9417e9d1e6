"""Everything torch on the forward path: the model runner, paged attention,
sampling, the Llama-family model (llama, with rope, layers, moe) and its
config (model_config, hf_config: the supported families), checkpoints,
tokenizers, the dense reference, and the vision side of multimodal inputs.
See docs/models.md."""
