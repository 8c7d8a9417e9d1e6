"""Everything torch on the forward path: the model runner, paged attention,
sampling, the Llama-family model and its config, checkpoints, tokenizers,
the dense reference, and the vision side of multimodal inputs."""
