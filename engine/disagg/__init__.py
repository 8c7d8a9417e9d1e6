"""The decode role of prefill/decode disaggregation: prefill workers,
transfer backends and the `kv_transfer` hook."""
